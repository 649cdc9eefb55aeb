"""specjax.compile_cache: compiled programs go to disk and a later process reads them; a
process near its memory-mapping limit frees them."""

import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROGRAM = """
import sys
import jax, jax.numpy as jnp
from jax._src import monitoring
from specjax import compile_cache
hits = []
monitoring.register_event_listener(lambda name, **kw: hits.append(name))
print(compile_cache.enable(sys.argv[1] if len(sys.argv) > 1 else None, min_compile_seconds=0))
print(float(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).sum()))
print("/jax/compilation_cache/cache_hits" in hits)
"""


def _run(*args, env=None):
  base = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env = dict(base, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **(env or {}))
  out = subprocess.run([sys.executable, "-c", _PROGRAM, *args], env=env, check=True,
                       capture_output=True, text=True).stdout.split()
  return out[0], float(out[1]), out[2] == "True"


def test_a_second_process_reads_the_program_the_first_compiled(tmp_path):
  path = str(tmp_path / "xla")
  first = _run(path)
  assert first[0] == path and not first[2] and os.listdir(path)
  second = _run(path)
  assert second == (path, first[1], True)  # a cache hit, and the same result


def test_default_path_is_under_the_specjax_cache_and_the_environment_wins(tmp_path):
  used, _, _ = _run(env={"SPECJAX_CACHE": str(tmp_path / "c")})
  assert used == str(tmp_path / "c" / "xla") and os.listdir(used)
  used, _, _ = _run(str(tmp_path / "ignored"),
                    env={"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "env")})
  assert used == str(tmp_path / "env") and not os.path.exists(tmp_path / "ignored")


_CROWDED = """
import sys
import jax, jax.numpy as jnp
from specjax import compile_cache
limit_file = sys.argv[1]
fs = [jax.jit(lambda x, i=i: jnp.tanh(x) * i + 1.0) for i in range(200)]
before = compile_cache.memory_mappings()
for f in fs:
  f(jnp.ones(4)).block_until_ready()
held = compile_cache.memory_mappings()
compile_cache.MAX_MAP_COUNT = limit_file
open(limit_file, "w").write(str(10 ** 9))
roomy = compile_cache.release_if_crowded()
open(limit_file, "w").write(str(held))
crowded = compile_cache.release_if_crowded(0.5)
after = compile_cache.memory_mappings()
print(before, held, int(roomy), int(crowded), after, float(fs[3](jnp.ones(4))[0]))
"""


def test_compiled_programs_hold_mappings_that_a_crowded_process_releases(tmp_path):
  """Every compiled XLA:CPU program holds memory mappings (a process may hold
  vm.max_map_count of them); ``release_if_crowded`` frees them all when the process holds
  more than the fraction asked, leaves them when it holds less, and a freed function
  compiles again on its next call."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  out = subprocess.run([sys.executable, "-c", _CROWDED, str(tmp_path / "max_map_count")],
                       env=env, check=True, capture_output=True, text=True).stdout.split()
  before, held, roomy, crowded, after = (int(x) for x in out[:5])
  assert held > before + 200  # at least a mapping a program
  assert (roomy, crowded) == (0, 1)
  assert after < before + (held - before) / 4  # most of them returned
  assert float(out[5]) == pytest.approx(np.tanh(1.0) * 3 + 1.0)  # compiled again, same result


def test_release_if_crowded_refuses_a_fraction_outside_0_1_and_knows_this_process():
  from specjax import compile_cache
  for bad in (0, -0.5, 1.5):
    with pytest.raises(ValueError, match="fraction must be in"):
      compile_cache.release_if_crowded(bad)
  assert compile_cache.memory_mappings() > 0  # Linux: /proc/self/maps
  assert compile_cache.mapping_limit() > 0
