"""experiments.phase_timing: phases timed inside one jitted loop, every repeat really run."""

import re

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


def _computations(hlo: str) -> dict[str, str]:
  """Compiled HLO text split into its computations, by name (ENTRY's under "ENTRY")."""
  out, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r"(ENTRY )?%([\w.\-]+) .*\{$", line)
    if head:
      name = "ENTRY" if head.group(1) else head.group(2)
      out[name] = ""
    elif name is not None:
      out[name] += line + "\n"
  return out


def _repeated_dots(hlo: str) -> tuple[int, int]:
  """(dots of the repeated phase inside the loop's body, those XLA moved out of it).

  The body is every computation reachable from the ``body=`` of a while that runs the
  repeats (its metadata names the while, not the scope within). A dot of the phase
  (metadata naming ``REPEAT_SCOPE``) anywhere else was hoisted: it runs once, not n times.
  """
  comps = _computations(hlo)
  calls = {name: set(re.findall(r"(?:body|condition|calls|to_apply)=%([\w.\-]+)", text))
           for name, text in comps.items()}
  loops = [m.group(1) for text in comps.values()
           for m in re.finditer(r"while\(.*body=%([\w.\-]+).*op_name=\"[^\"]*/while\"", text)]
  inside, todo = set(), [b for b in loops if phase_timing.REPEAT_SCOPE in comps.get(b, "")]
  while todo:
    name = todo.pop()
    if name not in inside:
      inside.add(name)
      todo.extend(calls.get(name, ()))
  counts = [0, 0]
  for name, text in comps.items():
    for line in text.splitlines():
      if " dot(" in line and f"/{phase_timing.REPEAT_SCOPE}/" in line:
        counts[name not in inside] += 1
  return counts[0], counts[1]


def _lowered(loops, setup, phase):
  dec, params, dp, state = setup
  draft_loop, verify_loop = loops
  key, n = jax.random.key(0), jnp.int32(2)
  if phase == "draft":
    return draft_loop.lower(dp, state, key, n)
  return verify_loop.lower(params, dp, state, key, n)


@pytest.mark.parametrize("phase", ["draft", "verify"])
def test_every_repeat_runs_inside_the_loop(setup, phase):
  """Every matrix product of the repeated phase stays in the compiled loop's body, so
  n repeats do n phases' work (XLA hoists a loop-invariant body out of the loop)."""
  hlo = _lowered(phase_timing._loops(setup[0]), setup, phase).compile().as_text()
  inside, hoisted = _repeated_dots(hlo)
  assert inside > 0 and hoisted == 0, (inside, hoisted)


@pytest.mark.parametrize("phase", ["draft", "verify"])
def test_without_the_dependency_xla_hoists_the_phase(setup, phase, monkeypatch):
  """The control: the same loops with the zero left out of the state are loop-invariant,
  and the compiled program computes the phase once, outside the loop."""
  monkeypatch.setattr(phase_timing, "_depend", lambda state, zero: state)
  hlo = _lowered(phase_timing._loops.__wrapped__(setup[0]), setup, phase).compile().as_text()
  inside, hoisted = _repeated_dots(hlo)
  assert hoisted > 0, (inside, hoisted)


def test_phase_seconds_are_reported_and_bad_arguments_refused(setup):
  """Structure only: a slope is a difference of two timings, which under the test run's
  load (4 workers on 2 cores) can come out negative, so its sign is not asserted."""
  dec, params, dp, state = setup
  out = phase_timing.fused_phase_seconds(dec, params, dp, state, repeats=3, min_seconds=0.01)
  assert np.isfinite([out["draft"], out["verify"]]).all() and len(out["draft_samples"]) == 3
  with pytest.raises(ValueError, match="must be >= 1"):
    phase_timing.fused_phase_seconds(dec, params, dp, state, repeats=0)
