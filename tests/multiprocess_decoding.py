"""One process of a two-process ``jax.distributed`` run on this machine's loopback.

  python tests/multiprocess_decoding.py --process_id=0 --port=PORT &
  python tests/multiprocess_decoding.py --process_id=1 --port=PORT

Each process owns 4 simulated CPU devices of one global 2x4 ("data", "model") mesh (gloo
collectives), shards the tiny test model over it, decodes the same prompts plainly and with a
greedy EAGLE chain, and prints its tokens as JSON; tests/test_sharding.py checks that both
processes agree with each other and with one device. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18], [19, 20, 21],
           [22, 23, 24, 25]]
NEW_TOKENS = 10


def decode(params_for, mesh=None) -> dict:
  """Plain and chain greedy tokens of the tiny model (``params_for`` places parameters)."""
  from specjax import testing
  from specjax.generate import generate
  from specjax.speculative import SpeculativeDecoder

  cfg, params = testing.tiny_model(dim=64, num_heads=16, num_kv_heads=8, ffn_dim=64,
                                   vocab_size=64)
  drafter, draft_params = testing.make_drafter("eagle", cfg, params, [])
  t, d = params_for(params, cfg), params_for(draft_params, cfg)
  plain = generate(t, cfg, PROMPTS, NEW_TOKENS, eos_ids=()).tokens
  chain = SpeculativeDecoder(cfg, drafter, gamma=3, eos_ids=()).generate(
      t, d, PROMPTS, NEW_TOKENS).tokens
  return {"plain": plain.tolist(), "chain": chain.tolist()}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--process_id", type=int, required=True)
  ap.add_argument("--num_processes", type=int, default=2)
  ap.add_argument("--port", type=int, required=True)
  a = ap.parse_args()
  jax.config.update("jax_num_cpu_devices", 4)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{a.port}", a.num_processes, a.process_id)
  from specjax import sharding

  mesh = sharding.make_mesh(data=2, model=4)
  with sharding.use_mesh(mesh):
    out = decode(lambda p, cfg: sharding.shard_params(p, cfg, mesh))
  out.update(process=jax.process_index(), processes=jax.process_count(),
             global_devices=len(jax.devices()), local_devices=len(jax.local_devices()))
  print(json.dumps(out))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
