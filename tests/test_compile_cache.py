"""specjax.compile_cache: compiled programs go to disk and a later process reads them."""

import os
import subprocess
import sys

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
