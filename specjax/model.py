"""A pure-functional Llama-family decoder: one forward for prefill, decode and verify.

Parameters are a plain pytree (dicts and a list of per-layer dicts), so they
can carry shardings. Q/K/V and gate/up projections are stored fused, which
turns seven skinny matmuls per layer into four.

Params layout (D model width, N/K query/kv heads, G = N/K, H head dim, F ffn width):
  embed       [V, D]
  layers[l]   attn_norm [D], wqkv [D, K(G+2)H], bqkv [K(G+2)H] (Qwen2 only),
              wo [NH, D], mlp_norm [D], w_gate_up [D, 2F], w_down [F, D]
  final_norm  [D]
  lm_head     [D, V] (absent when embeddings are tied)

The fused columns are grouped per kv head (q heads, key, value) and per feature
(gate, up), so they split cleanly for tensor parallelism (``param_layout``).

A layer without ``attn_norm`` attends over its input un-normalised (the first
layer of a published EAGLE-1 drafter; a target always has it,
``validation.check_params``). ``run_layers``' ``attn_prefix`` widens layer 0's
attention input (EAGLE-3's drafter layer: its ``wqkv`` is [P + D, (N+2K)H]).

Any projection (and ``lm_head``, even with tied embeddings) may instead be a
``kernels.packed.PackedWeight`` (``load_model`` packs on CPU): every product
goes through ``sharding.dense`` (``kernels.packed.dense``, and on a mesh a packed weight's
kernel per device).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax import attention as attn_lib
from specjax import kv_cache as kvc
from specjax import param_layout
from specjax.config import ModelConfig
from specjax.kernels.accumulate import einsum_f32
from specjax.kernels.packed import PackedWeight, uses_kernel
from specjax.rope import apply_rope, inverse_frequencies, rope_tables
from specjax.sharding import dense

Params = dict[str, Any]


class ForwardOutput(NamedTuple):
  """What one forward pass returns.

  Attributes:
    logits: [B, T, V] float32, or None when ``compute_logits=False``.
    hidden: [B, T, D] output of the last decoder layer, before the final norm.
    intermediates: tuple of [B, T, D], the outputs of the requested layers.
    cache: the cache with the T new entries written and lengths advanced.
  """

  logits: Optional[jax.Array]
  hidden: jax.Array
  intermediates: tuple[jax.Array, ...]
  cache: kvc.KVCache


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def compute_dtype(params: Params) -> jnp.dtype:
  """The dtype of a model's activations, KV cache and features: its embedding table's.

  float32 by default; bfloat16 after ``cast_params(params, jnp.bfloat16)``. Products
  accumulate in float32 whatever it is (``kernels.packed.dense``), and logits are float32.
  """
  return jnp.dtype(params["embed"].dtype)


def cast_params(params: Any, dtype) -> Any:
  """Every floating-point array of a parameter pytree in ``dtype``; integer arrays (vocabulary
  maps) and packed CPU weights (float32 or float16 panels, ``kernels.packed``) are left as they are."""
  dtype = jnp.dtype(dtype)

  def cast(x):
    if isinstance(x, PackedWeight) or not hasattr(x, "dtype"):
      return x
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

  return jax.tree.map(cast, params, is_leaf=lambda x: isinstance(x, PackedWeight))


def causal_mask(batch_size: int, num_tokens: int) -> jax.Array:
  """[B, T, T] lower-triangular mask: new token i sees new tokens j <= i."""
  tri = jnp.tril(jnp.ones((num_tokens, num_tokens), bool))
  return jnp.broadcast_to(tri, (batch_size, num_tokens, num_tokens))


def _layer(cfg: ModelConfig, p: Params, x: jax.Array, rope: tuple[jax.Array, jax.Array],
           k_cache: jax.Array, v_cache: jax.Array, start: jax.Array, mask: jax.Array,
           attention_impl: str, attn_prefix: Optional[jax.Array] = None):
  # The T new tokens are the last T slots of a window of W = mask.shape[-1]
  # slots that starts at ``start`` (W = T except while drafting a tree).
  write_start = start + (mask.shape[-1] - x.shape[1])
  b, t, _ = x.shape
  n, kh, h, g = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.group_size
  y = rms_norm(x, p["attn_norm"], cfg.norm_eps) if "attn_norm" in p else x
  if attn_prefix is not None:  # [B, T, P] read by the attention beside y, not by the residual
    y = jnp.concatenate([attn_prefix, y], axis=-1)
  qkv = dense(y, p["wqkv"])
  if "bqkv" in p:
    qkv = qkv + p["bqkv"]
  qkv = qkv.reshape(b, t, kh, (g + 2) * h)  # per kv head: G queries, key, value
  q = apply_rope(qkv[..., :g * h].reshape(b, t, n, h), rope)
  k = apply_rope(qkv[..., g * h:(g + 1) * h], rope)
  v = qkv[..., (g + 1) * h:]
  k_cache = kvc.write_layer(k_cache, k, write_start)
  v_cache = kvc.write_layer(v_cache, v, write_start)
  attn = attn_lib.attention(q, k_cache, v_cache, start, mask,
                            impl=attention_impl).reshape(b, t, n * h)
  x = x + dense(attn, p["wo"])
  y = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
  gate_up = dense(y, p["w_gate_up"]).reshape(b, t, -1, 2)  # per feature: gate, up
  gate, up = gate_up[..., 0], gate_up[..., 1]
  x = x + dense(jax.nn.silu(gate) * up, p["w_down"])
  return x, k_cache, v_cache


def embed_inputs(params: Params, tokens: jax.Array) -> jax.Array:
  """[.., D] input embeddings of ``tokens``: rows of ``embed`` by default.

  A reduced-vocabulary draft with full-vocabulary input
  (``ModelDrafter.make_params(input_embed=...)``) carries ``input_embed``
  [V_in, D], the target's table, which the ids index instead, and
  ``input_rows`` [V_in] int32: ids whose entry is >= 0 read that row of its own
  ``embed`` (trained), the rest the target's row. The target's table is shared,
  not copied; ``embed`` stays the tied output head. Example: input_rows
  [-1, 0, -1, 2]: id 1 reads embed[0], id 2 input_embed[2].
  """
  if "input_embed" not in params:
    return params["embed"][tokens]
  x = params["input_embed"][tokens]
  if "input_rows" not in params:
    return x
  rows = params["input_rows"][tokens]
  own = params["embed"][jnp.maximum(rows, 0)].astype(x.dtype)
  return jnp.where((rows >= 0)[..., None], own, x)


def lm_head(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
  """Final norm + output projection: [B, T, D] -> [B, T, V] float32 logits."""
  x = rms_norm(hidden, params["final_norm"], cfg.norm_eps)
  head = params.get("lm_head")
  rows = int(np.prod(x.shape[:-1]))
  # A packed head (kernels.packed.pack_params) goes to the kernel for the row
  # counts its policy gives it; a tied one contracts against ``embed`` otherwise.
  if isinstance(head, PackedWeight) and (uses_kernel(head, rows) or not cfg.tie_embeddings):
    return dense(x, head)
  if cfg.tie_embeddings:  # contract against [V, D] directly: no transposed copy
    return einsum_f32("...d,vd->...v", x, params["embed"])
  return einsum_f32("...d,dv->...v", x, params["lm_head"])


def run_layers(params: Params, cfg: ModelConfig, x: jax.Array, positions: jax.Array,
               cache: kvc.KVCache, mask: Optional[jax.Array] = None,
               num_valid: Optional[jax.Array] = None, return_layers: tuple[int, ...] = (),
               attention_impl: str = "auto", attn_prefix: Optional[jax.Array] = None
               ) -> tuple[jax.Array, tuple[jax.Array, ...], kvc.KVCache]:
  """The decoder layers over input embeddings ``x`` [B, T, D] (see ``forward``).

  Returns (hidden [B, T, D] before the final norm, intermediates, new cache).
  Feature drafters (EAGLE) call this with their own input projection; ``attn_prefix``
  [B, T, P] is concatenated before layer 0's normalised input where its attention
  reads it (EAGLE-3: [norm(token embedding); norm(x)]), while its residual stream
  stays ``x``.
  """
  b, t = x.shape[:2]
  if mask is None:
    mask = causal_mask(b, t)
  if num_valid is None:
    num_valid = jnp.full((b,), t, jnp.int32)
  rope = rope_tables(positions, inverse_frequencies(cfg))
  ks, vs, inter = [], [], []
  for l, p in enumerate(params["layers"]):
    x, k_l, v_l = _layer(cfg, p, x, rope, cache.k[l], cache.v[l], cache.lengths,
                         mask, attention_impl, attn_prefix if l == 0 else None)
    ks.append(k_l)
    vs.append(v_l)
    if l in return_layers:
      inter.append(x)
  new_cache = kvc.KVCache(k=tuple(ks), v=tuple(vs),
                          lengths=cache.lengths + num_valid.astype(jnp.int32))
  return x, tuple(inter), new_cache


@functools.partial(jax.jit, static_argnames=("cfg", "compute_logits", "return_layers",
                                             "attention_impl"))
def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: kvc.KVCache, mask: Optional[jax.Array] = None,
            num_valid: Optional[jax.Array] = None, *, compute_logits: bool = True,
            return_layers: tuple[int, ...] = (), attention_impl: str = "auto"
            ) -> ForwardOutput:
  """Runs T new tokens per row against the cache.

  Args:
    params: model parameters.
    cfg: static model config.
    tokens: [B, T] int token ids.
    positions: [B, T] int RoPE positions (explicit, so token trees can share one).
    cache: the KV cache; new keys/values go to slots ``cache.lengths[b] + j``.
    mask: [B, T, T] bool, which new tokens each new token sees (default causal).
      The committed prefix is always visible. A wider [B, T, W] mask (W > T)
      makes the T tokens the *last* T of a window of W slots after the
      committed prefix: they are written at slots ``lengths + W - T + j`` and
      see window slot j iff ``mask[b, i, j]`` (how a drafter extends a token
      tree one depth at a time over nodes it already wrote; reference
      attention only).
    num_valid: [B] how many of the T tokens to commit (lengths advance by this);
      default T. Padding tokens beyond it are written as scratch.
    compute_logits: skip the LM head (e.g. during prefill) when False.
    return_layers: indices of decoder layers whose outputs to return.
    attention_impl: static name of the attention implementation
      (``specjax.attention.IMPLS``; "auto" is the CPU kernel on CPU and the
      Pallas kernel on TPU/GPU, each where it takes the block, else the reference).

  Returns:
    ForwardOutput with logits, last hidden state, intermediates and new cache.
  """
  x, inter, new_cache = run_layers(params, cfg, embed_inputs(params, tokens), positions, cache,
                                   mask, num_valid, return_layers, attention_impl)
  logits = lm_head(cfg, params, x) if compute_logits else None
  return ForwardOutput(logits=logits, hidden=x, intermediates=inter, cache=new_cache)


def target_features(out: ForwardOutput, layers: tuple[int, ...] = ()) -> jax.Array:
  """What feature drafters read: [B, T, D] last hidden state (``layers`` empty) or the
  outputs of ``layers`` concatenated, [B, T, len(layers)·D] (the forward must have been
  run with ``return_layers=layers``, sorted)."""
  if not layers:
    return out.hidden
  if len(out.intermediates) != len(layers):
    raise ValueError(f"the forward returned {len(out.intermediates)} layers' outputs, but "
                     f"features of layers {layers} were asked for")
  return jnp.concatenate(out.intermediates, axis=-1)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
  """Random parameters (tests, toy models, drafts trained from scratch), in the fused
  layout of ``param_layout``."""
  n, kh, h, d, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dim, cfg.ffn_dim
  keys = iter(jax.random.split(key, 6 * cfg.num_layers + 2))
  normal = lambda shape: (scale * jax.random.normal(next(keys), shape)).astype(dtype)
  layers = []
  for _ in range(cfg.num_layers):
    layer = {
        "attn_norm": jnp.ones((d,), dtype),
        "wqkv": normal((d, (n + 2 * kh) * h)),
        "wo": normal((n * h, d)),
        "mlp_norm": jnp.ones((d,), dtype),
        "w_gate_up": normal((d, 2 * f)),
        "w_down": normal((f, d)),
    }
    if cfg.qkv_bias:
      layer["bqkv"] = normal(((n + 2 * kh) * h,))
    # Drawn as q|k|v and gate|up blocks, then reordered: a seed gives the same model as
    # before param_layout existed (tests and notebooks seed their toy models).
    layers.append(param_layout.from_concatenated(layer, n, kh, h))
  params = {"embed": normal((cfg.vocab_size, d)), "layers": layers,
            "final_norm": jnp.ones((d,), dtype)}
  if not cfg.tie_embeddings:
    params["lm_head"] = normal((d, cfg.vocab_size))
  return params
