"""Published EAGLE drafters, loaded unchanged: SafeAILab's EAGLE-1/2 and EAGLE-3 checkpoints.

A checkpoint directory holds ``config.json`` (Llama fields) and
``model.safetensors`` or ``pytorch_model.bin`` (read with torch, and only when
torch is importable; safetensors is preferred when both exist). Tensors are
torch ``[out, in]``; D hidden, V vocabulary, Vd draft vocabulary, F ffn, N/K
heads, H = D // N (a config ``head_dim`` is ignored, as by the reference)::

  EAGLE-1/2 (eagle/model/cnets1.py)        EAGLE-3 (eagle/model/cnets.py)
  fc.weight [D, 2D], fc.bias [D] iff        fc.weight [D, 3D]
    "bias" (default true)
  layers.{i}.self_attn.{q,k,v,o}_proj       midlayer.self_attn.{q,k,v}_proj [·, 2D], o_proj
  layers.{i}.mlp.{gate,up,down}_proj        midlayer.mlp.{gate,up,down}_proj
  layers.{i}.post_attention_layernorm       midlayer.{hidden_norm,input_layernorm,
  layers.{i}.input_layernorm (i > 0 only)     post_attention_layernorm}, norm.weight
  q/k/v biases iff "qkv_bias"               lm_head.weight [Vd, D], d2t [Vd] int, t2d [V]
                                              bool (may be absent when Vd = V)
  embed_tokens.weight [V, D] optional in both; ``*rotary_emb.inv_freq`` ignored

They become an ``EagleDrafter`` with the published wiring (``eagle_arch.eagle1``,
``EAGLE3``): q/k/v fused into ``wqkv`` as ``loaders.hf_layout`` does (HF Llama
weights are already in specjax's rotate-half RoPE layout), EAGLE-1's layer 0
without ``attn_norm``, EAGLE-3's ``fc`` as the fusion ``fuse`` of the inputs of
the target's layers 2, L//2 and L − 3 (outputs of layers 1, L//2 − 1, L − 4),
``hidden_norm`` as its layer's ``attn_norm``, ``input_layernorm`` as
``embed_norm`` and target ids = draft id + d2t as ``vocab_map``. The embedding
is the checkpoint's when it has one (the reference loads it over the
target's), else the target's; floats are cast to the target's compute dtype.

Checked before any weight is read (config.json and tensor headers only, plus
the small d2t/t2d): the architecture (tensor names, one EAGLE-3 midlayer, SiLU,
no RoPE scaling), the target it was built for (hidden size, vocabulary, d2t's
range, the target layers EAGLE-3 reads), missing, extra and misshapen tensors
and their dtypes; then every weight must be finite.

Departures from the reference: a row whose committed length is 1 (a one-token
prompt's first step) has no pair yet, where the reference has always run the
target once; specjax drafts it from the pair (0, x_0), as scratch. Pair p sits
at RoPE position p, one past the reference's (attention sees relative
positions only). RoPE scaling (the reference's linear and dynamic) and an
EAGLE-3 drafter narrower or wider than its target (``target_hidden_size`` ≠
``hidden_size``) are refused rather than implemented. The checkpoints carry no
tokenizer, so none is fingerprinted. Beyond the reference, config.json's
``eagle_config.eagle_aux_hidden_state_layer_ids`` (vLLM's field) names the
target layers EAGLE-3 reads when present.
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.drafters.eagle import EagleDrafter, pack_eagle_params
from specjax.drafters.residual_head import target_head
from specjax.drafters import eagle_arch
from specjax.drafts.format import checked_vocab_map
from specjax.kernels.packed import head_policy_of, policy_of
from specjax.loaders.hf import CheckpointError, read_config_json
from specjax.model import Params, compute_dtype
from specjax.param_layout import fuse_gate_up, fuse_qkv
from specjax.validation import all_finite

EAGLE1, EAGLE3 = "EAGLE-1/2", "EAGLE-3"  # the two published kinds
_IGNORED_SUFFIX = "rotary_emb.inv_freq"  # recomputed from the config
_ST_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "BOOL": "bool"}
_KINDS = {"float": ("float16", "bfloat16", "float32", "float64"), "int": ("int64", "int32"),
          "bool": ("bool",)}
_KIND_NAMES = {"float": "a float", "int": "an integer", "bool": "a bool"}


class _Checkpoint(NamedTuple):
  """A weights file: each tensor's (shape, dtype name) from its header, and a reader."""

  file: str
  meta: dict[str, tuple[tuple[int, ...], str]]
  get: Callable[[str], np.ndarray]


# ------------------------------------------------------------------ files


def published_eagle_weights(path: str) -> Optional[str]:
  """The weights file of ``path`` when it looks like a published EAGLE checkpoint, else None.

  That is a ``config.json`` beside a ``model.safetensors`` holding ``fc.weight`` (a
  whole Llama model has none), or beside a ``pytorch_model.bin`` and no safetensors
  (which ``loaders.load_model`` cannot read anyway; ``load_published_eagle`` then says
  what it is). Reads tensor names only.
  """
  if not os.path.isfile(os.path.join(path, "config.json")):
    return None
  single = os.path.join(path, "model.safetensors")
  if os.path.isfile(single):
    try:
      from safetensors import safe_open
      with safe_open(single, framework="numpy") as f:
        return single if "fc.weight" in f.keys() else None
    except Exception:  # pylint: disable=broad-except  # corrupt: the HF loader reports it
      return None
  pickle = os.path.join(path, "pytorch_model.bin")
  if os.path.isfile(pickle) and not os.path.exists(
      os.path.join(path, "model.safetensors.index.json")):
    return pickle
  return None


def _open_safetensors(file: str) -> _Checkpoint:
  from safetensors import safe_open
  try:
    f = safe_open(file, framework="numpy")
    meta = {}
    for name in f.keys():
      s = f.get_slice(name)
      meta[name] = (tuple(s.get_shape()), _ST_DTYPES.get(s.get_dtype(), s.get_dtype().lower()))
  except Exception as e:  # safetensors raises its own error types
    raise CheckpointError(f"corrupt safetensors file {file}: {e}") from None
  return _Checkpoint(file, meta, f.get_tensor)


def _open_pickle(file: str) -> _Checkpoint:
  """A ``pytorch_model.bin`` through torch (memory-mapped where the file allows)."""
  try:
    import torch  # pylint: disable=import-outside-toplevel  # optional: never at module level
  except ImportError:
    raise CheckpointError(
        f"{file} is a PyTorch pickle and torch is not installed: convert it to "
        "model.safetensors where torch is (safetensors.torch.save_file(torch.load(f), "
        "'model.safetensors')) and put that beside config.json") from None
  try:
    try:
      sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # files older than torch's zip format cannot be memory-mapped
      sd = torch.load(file, map_location="cpu", weights_only=True)
  except Exception as e:  # pylint: disable=broad-except  # torch's many unpickling errors
    raise CheckpointError(f"corrupt or unsafe PyTorch checkpoint {file}: {e}") from None
  if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
    raise CheckpointError(f"{file} is not a state dict of tensors")
  meta = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}
  get = lambda name: (sd[name].float() if sd[name].dtype == torch.bfloat16 else sd[name]).numpy()
  return _Checkpoint(file, meta, get)


def _open(path: str) -> _Checkpoint:
  single = os.path.join(path, "model.safetensors")
  if os.path.isfile(single):
    return _open_safetensors(single)
  pickle = os.path.join(path, "pytorch_model.bin")
  if os.path.isfile(pickle):
    return _open_pickle(pickle)
  raise CheckpointError(f"{path!r} holds no model.safetensors or pytorch_model.bin")


# ------------------------------------------------------------------ checks


def _kind(c: dict[str, Any], names: set[str], path: str) -> str:
  """EAGLE-1/2 or EAGLE-3, from the tensor names; anything else is refused."""
  mid = any(n.startswith("midlayer.") for n in names)
  stack = any(n.startswith("layers.") for n in names)
  if "fc.weight" not in names or mid == stack:
    raise CheckpointError(
        f"{path!r} is not a checkpoint of a supported architecture: specjax loads SafeAILab's "
        "EAGLE-1/2 (fc.weight and layers.{i}.*) and EAGLE-3 (fc.weight and midlayer.*) "
        f"drafters; its tensors are e.g. {sorted(names)[:4]}")
  if mid and "draft_vocab_size" not in c:
    raise CheckpointError(f"config.json in {path!r} lacks draft_vocab_size, which an EAGLE-3 "
                          "checkpoint (midlayer.*) has")
  if mid and (not isinstance(c["draft_vocab_size"], int) or c["draft_vocab_size"] < 1):
    raise CheckpointError(f"config.json in {path!r}: draft_vocab_size "
                          f"{c['draft_vocab_size']!r} is not a positive integer")
  return EAGLE3 if mid else EAGLE1


def _draft_config(c: dict[str, Any], kind: str, target_cfg: ModelConfig, path: str
                  ) -> ModelConfig:
  """The drafter's layer stack from config.json, checked against the reference and the target."""
  try:
    d, n = int(c["hidden_size"]), int(c["num_attention_heads"])
    cfg = ModelConfig(vocab_size=int(c["vocab_size"]), dim=d,
                      num_layers=int(c["num_hidden_layers"]), num_heads=n,
                      num_kv_heads=int(c.get("num_key_value_heads") or n),
                      ffn_dim=int(c["intermediate_size"]), head_dim=d // max(n, 1),
                      rope_theta=float(c.get("rope_theta", 10000.0)),
                      norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                      name=f"{target_cfg.name}-{'eagle3' if kind == EAGLE3 else 'eagle1'}")
  except KeyError as e:
    raise CheckpointError(f"config.json in {path!r} lacks the field {e.args[0]!r}") from None
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"config.json in {path!r} describes no valid drafter: {e}") from None
  if c.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"{path!r}: hidden_act {c['hidden_act']!r} is not supported (SiLU "
                          "only)")
  if c.get("rope_scaling"):
    raise CheckpointError(f"{path!r}: rope_scaling {c['rope_scaling']} is not supported: the "
                          "published-EAGLE loader implements unscaled RoPE only (the reference "
                          "also knows linear and dynamic scaling)")
  if kind == EAGLE3 and cfg.num_layers != 1:
    raise CheckpointError(f"{path!r}: an EAGLE-3 checkpoint has one midlayer, but config.json "
                          f"says num_hidden_layers={cfg.num_layers}")
  if d % n:  # the reference's head dim is hidden_size // heads, and it refuses a remainder
    raise CheckpointError(f"{path!r}: hidden_size {d} is not a multiple of the {n} heads")
  widths = {"hidden_size": d}
  if kind == EAGLE3:
    widths["target_hidden_size"] = int(c.get("target_hidden_size", d))
  for field, width in widths.items():
    if width != target_cfg.dim:
      raise ValueError(f"EAGLE drafter {path!r} was built for another target: its {field} is "
                       f"{width}, this target's hidden size is {target_cfg.dim}")
  if cfg.vocab_size != target_cfg.vocab_size:
    raise ValueError(f"EAGLE drafter {path!r} was built for another target: its vocabulary has "
                     f"{cfg.vocab_size} tokens, this target's {target_cfg.vocab_size}")
  return cfg


def _layer_shapes(pre: str, cfg: ModelConfig, width: int) -> dict[str, tuple[int, ...]]:
  """Attention and MLP [out, in] shapes of a layer whose q/k/v read ``width`` inputs."""
  d, f, h = cfg.dim, cfg.ffn_dim, cfg.head_dim
  return {f"{pre}.self_attn.q_proj.weight": (cfg.num_heads * h, width),
          f"{pre}.self_attn.k_proj.weight": (cfg.num_kv_heads * h, width),
          f"{pre}.self_attn.v_proj.weight": (cfg.num_kv_heads * h, width),
          f"{pre}.self_attn.o_proj.weight": (d, cfg.num_heads * h),
          f"{pre}.mlp.gate_proj.weight": (f, d), f"{pre}.mlp.up_proj.weight": (f, d),
          f"{pre}.mlp.down_proj.weight": (d, f),
          f"{pre}.post_attention_layernorm.weight": (d,)}


def _expected(c: dict[str, Any], kind: str, cfg: ModelConfig):
  """(required, optional): tensor name -> (shape, "float" | "int" | "bool")."""
  d, v = cfg.dim, cfg.vocab_size
  optional = {"embed_tokens.weight": (v, d)}
  if kind == EAGLE1:
    required = {"fc.weight": (d, 2 * d)}
    if c.get("bias", True):
      required["fc.bias"] = (d,)
    for i in range(cfg.num_layers):
      required.update(_layer_shapes(f"layers.{i}", cfg, d))
      if i:
        required[f"layers.{i}.input_layernorm.weight"] = (d,)
      if c.get("qkv_bias"):
        for x, heads in zip("qkv", (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)):
          required[f"layers.{i}.self_attn.{x}_proj.bias"] = (heads * cfg.head_dim,)
    kinds = {}
  else:
    vd = int(c["draft_vocab_size"])
    required = dict(_layer_shapes("midlayer", cfg, 2 * d), **{
        "fc.weight": (d, 3 * d), "midlayer.hidden_norm.weight": (d,),
        "midlayer.input_layernorm.weight": (d,), "norm.weight": (d,), "lm_head.weight": (vd, d)})
    maps = {"d2t": (vd,), "t2d": (v,)}
    (optional if vd == v else required).update(maps)  # the reference ignores them when Vd = V
    kinds = {"d2t": "int", "t2d": "bool"}
  with_kind = lambda shapes: {k: (s, kinds.get(k, "float")) for k, s in shapes.items()}
  return with_kind(required), with_kind(optional)


def _check_tensors(ckpt: _Checkpoint, required: dict, optional: dict) -> None:
  names = {n for n in ckpt.meta if not n.endswith(_IGNORED_SUFFIX)}
  missing, extra = sorted(set(required) - names), sorted(names - set(required) - set(optional))
  if missing:
    raise CheckpointError(f"{ckpt.file}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}: "
                          "config.json does not describe this checkpoint")
  if extra:
    raise CheckpointError(f"{ckpt.file}: {len(extra)} tensor(s) the architecture does not use, "
                          f"e.g. {extra[:3]}: config.json does not describe this checkpoint")
  for name, (shape, kind) in {**required, **optional}.items():
    if name not in names:
      continue
    have, dtype = ckpt.meta[name]
    if have != shape:
      raise CheckpointError(f"{ckpt.file}: tensor {name!r} has shape {have}, but config.json "
                            f"implies {shape}")
    if dtype not in _KINDS[kind]:
      raise CheckpointError(f"{ckpt.file}: tensor {name!r} has dtype {dtype}, not "
                            f"{_KIND_NAMES[kind]}")


def eagle3_feature_layers(c: dict[str, Any], target_cfg: ModelConfig) -> tuple[int, ...]:
  """The target layer *outputs* an EAGLE-3 drafter reads: it fuses the inputs of layers 2,
  L//2 and L − 3 (or config.json's ``eagle_config.eagle_aux_hidden_state_layer_ids``, the
  vLLM/SpecForge field), i.e. the outputs of the layers just below. Example: L = 8 →
  inputs of 2, 4, 5 → outputs (1, 3, 4)."""
  n = target_cfg.num_layers
  ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
  where = ("config.json's eagle_aux_hidden_state_layer_ids" if ids is not None
           else f"layers 2, L//2 and L-3 of a target of L = {n} layers")
  ids = (2, n // 2, n - 3) if ids is None else tuple(ids)
  if (len(set(ids)) != 3 or not all(isinstance(i, int) and 1 <= i < n for i in ids)):
    raise ValueError(f"an EAGLE-3 drafter reads the inputs of three distinct target layers past "
                     f"the first, but {where} give {list(ids)}: its fc cannot be fed by this "
                     "target")
  return tuple(sorted(i - 1 for i in set(ids)))


def _vocab_map(ckpt: _Checkpoint, vd: int, v: int) -> np.ndarray:
  """[Vd] target ids of the draft ids (id + d2t[id]), checked, with t2d if present."""
  ids = np.arange(vd) + np.asarray(ckpt.get("d2t"), np.int64)
  if ids.min() < 0 or ids.max() >= v:
    raise ValueError(f"{ckpt.file}: d2t maps draft ids to target ids up to {ids.max()} (from "
                     f"{ids.min()}), outside this target's vocabulary of {v}: built for "
                     "another target")
  ids = checked_vocab_map(ids, v, f"{ckpt.file}: d2t")  # refuses two draft ids of one token
  if "t2d" in ckpt.meta and not np.array_equal(np.flatnonzero(ckpt.get("t2d")), np.sort(ids)):
    raise CheckpointError(f"{ckpt.file}: t2d and d2t disagree on the draft vocabulary")
  return ids


# ------------------------------------------------------------------ loading


def load_published_eagle(path: str, target_cfg: ModelConfig, target_params: Params,
                         panel_dtype=None) -> tuple[EagleDrafter, Params]:
  """(EagleDrafter, draft_params) of a SafeAILab EAGLE-1/2 or EAGLE-3 checkpoint directory,
  packed like the target in panels of ``panel_dtype`` (``drafters.eagle.pack_eagle_params``).

  Raises:
    ValueError: a drafter built for another target (hidden size, vocabulary, d2t's
      range, target layers).
    CheckpointError (a ValueError): an unsupported architecture, missing, extra or
      misshapen tensors, wrong dtypes, non-finite weights, unreadable files.
  """
  c = read_config_json(path, "EAGLE checkpoint directory")
  ckpt = _open(path)
  kind = _kind(c, set(ckpt.meta), path)
  cfg = _draft_config(c, kind, target_cfg, path)
  _check_tensors(ckpt, *_expected(c, kind, cfg))
  layers = eagle3_feature_layers(c, target_cfg) if kind == EAGLE3 else ()
  vd = int(c.get("draft_vocab_size", cfg.vocab_size))
  vocab_map = _vocab_map(ckpt, vd, cfg.vocab_size) if vd != cfg.vocab_size else None

  # Everything is checked: read the weights.
  dtype = compute_dtype(target_params)

  def w(name: str) -> jax.Array:
    a = np.asarray(ckpt.get(name), np.float32)
    if not all_finite(a):
      raise CheckpointError(f"{ckpt.file}: tensor {name!r} holds non-finite values (NaN or "
                            "inf): the checkpoint is corrupt")
    return jnp.asarray(a, dtype)

  def layer(pre: str, attn_norm: Optional[str]) -> Params:
    t = lambda name: jnp.transpose(w(f"{pre}.{name}.weight"))  # [out, in] -> [in, out]
    p = {"wqkv": fuse_qkv(*[t(f"self_attn.{x}_proj") for x in "qkv"], cfg.num_kv_heads),
         "wo": t("self_attn.o_proj"), "mlp_norm": w(f"{pre}.post_attention_layernorm.weight"),
         "w_gate_up": fuse_gate_up(t("mlp.gate_proj"), t("mlp.up_proj")),
         "w_down": t("mlp.down_proj")}
    if attn_norm is not None:
      p["attn_norm"] = w(attn_norm)
    if f"{pre}.self_attn.q_proj.bias" in ckpt.meta:
      p["bqkv"] = fuse_qkv(*[w(f"{pre}.self_attn.{x}_proj.bias") for x in "qkv"],
                           cfg.num_kv_heads)
    return p

  embed = (w("embed_tokens.weight") if "embed_tokens.weight" in ckpt.meta
           else target_params["embed"])
  if kind == EAGLE1:
    dp = {"fc": jnp.transpose(w("fc.weight")), "embed": embed,
          "layers": [layer(f"layers.{i}", f"layers.{i}.input_layernorm.weight" if i else None)
                     for i in range(cfg.num_layers)],
          "target_norm": target_params["final_norm"],
          "head": target_head(target_cfg, target_params)}
    if "fc.bias" in ckpt.meta:
      dp["fc_bias"] = w("fc.bias")
    drafter = EagleDrafter(cfg, arch=eagle_arch.eagle1(target_cfg.norm_eps))
  else:
    dp = {"fuse": jnp.transpose(w("fc.weight")), "embed": embed,
          "embed_norm": w("midlayer.input_layernorm.weight"),
          "layers": [layer("midlayer", "midlayer.hidden_norm.weight")],
          "final_norm": w("norm.weight"), "head": w("lm_head.weight")}
    if vocab_map is not None:
      dp["vocab_map"] = jnp.asarray(vocab_map)
    drafter = EagleDrafter(cfg, feature_layers=layers, arch=eagle_arch.EAGLE3)
  drafter.check_params(dp)
  return drafter, pack_eagle_params(dp, policy_of(target_params),
                                    head_policy_of(target_params), panel_dtype)


def published_kind(drafter: EagleDrafter) -> str:
  """"EAGLE-3" or "EAGLE-1/2": which published wiring a loaded drafter has."""
  return EAGLE3 if drafter.arch == eagle_arch.EAGLE3 else EAGLE1
