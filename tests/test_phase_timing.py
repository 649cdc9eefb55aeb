"""experiments.phase_timing: phases timed inside one jitted loop, every repeat really run."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import phase_timing
from specjax.drafters import ModelDrafter
from specjax.sampling import Greedy
from specjax.speculative import SpeculativeDecoder
from specjax.testing import tiny_model


@pytest.fixture(scope="module")
def setup():
  cfg, params = tiny_model(0)
  dcfg, dparams = tiny_model(1, num_layers=1)
  dec = SpeculativeDecoder(cfg, ModelDrafter(dcfg), gamma=3, sampler=Greedy())
  dp = dec.drafter.make_params(dparams)
  for i, (state, _) in enumerate(dec.stream(params, dp, [[1, 2, 3], [4, 5]], 12)):
    if i == 1:
      break
  return dec, params, dp, state


def test_the_dependency_is_a_zero_that_changes_nothing(setup):
  _, _, _, state = setup
  same = phase_timing._depend(state, jnp.int32(0))
  plain = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(same)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(plain(a)), np.asarray(plain(b)))


@pytest.mark.parametrize("phase", ["draft", "verify"])
def test_every_repeat_runs(setup, phase):
  """If XLA hoisted the phase out of the loop (a loop-invariant body), 512 repeats would
  cost about what 2 do; run, they cost over 20 times more (about 250 times here)."""
  dec, params, dp, state = setup
  draft_loop, verify_loop = phase_timing._loops(dec)
  key = jax.random.key(0)
  run = ((lambda n: draft_loop(dp, state, key, jnp.int32(n))) if phase == "draft" else
         (lambda n: verify_loop(params, dp, state, key, jnp.int32(n))))
  jax.block_until_ready(run(2))

  def best(n):
    times = []
    for _ in range(3):
      t0 = time.perf_counter()
      jax.block_until_ready(run(n))
      times.append(time.perf_counter() - t0)
    return min(times)

  assert best(512) > 20 * best(2)


def test_phase_seconds_are_positive_and_bad_arguments_refused(setup):
  dec, params, dp, state = setup
  out = phase_timing.fused_phase_seconds(dec, params, dp, state, repeats=3, min_seconds=0.01)
  assert out["draft"] > 0 and out["verify"] > 0 and len(out["draft_samples"]) == 3
  with pytest.raises(ValueError, match="must be >= 1"):
    phase_timing.fused_phase_seconds(dec, params, dp, state, repeats=0)
