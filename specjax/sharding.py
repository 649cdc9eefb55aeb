"""Tensor- and data-parallel decoding on a ``jax.sharding`` mesh: logical axes mapped to mesh
axes by rules, as in maxtext and levanter.

Every parameter, KV-cache and decoding-state leaf has logical axes; ``ShardingRules`` maps
each logical axis to a mesh axis (or to None: replicated). The defaults:

  batch     -> "data"    rows of prompts, caches and every decoding-state leaf
  kv_heads  -> "model"   ``wqkv`` columns and ``wo`` rows (whole kv groups: their query
                         heads, key and value, ``param_layout``), caches' kv heads
  ffn       -> "model"   ``w_gate_up`` columns (gate and up of a feature together), ``w_down`` rows
  vocab     -> "model"   ``embed`` rows, ``lm_head`` columns, drafters' ``head`` rows
  embed     -> None      the model width, norms, everything else

So the target runs Megatron-style: attention and the MLP shard-locally, one all-reduce after
``wo`` and one after ``w_down``; the logits are vocabulary-sharded. GSPMD (``jax.jit`` with
sharded inputs) inserts the collectives; nothing here is hand-written communication.

Usage::

  mesh = make_mesh(data=2, model=4)
  with use_mesh(mesh):                      # jax.set_mesh + these rules
    params = shard_params(params, cfg, mesh)
    out = generate(params, cfg, prompts, 128)       # or SpeculativeDecoder(...).generate

Inside ``use_mesh`` the jitted loops pin their state to the rules (``constrain``): rows on
"data", cache kv heads on "model". Drafters' parameters are sharded by the same key names
(``shard_params(draft_params, cfg, mesh)``) or replicated (``rules=REPLICATED``); a leaf whose
key has no rule (Medusa's residual blocks, n-gram tables) is replicated.

Departures from maxtext/levanter, and why:
  * Divisibility is checked in units, not elements: a "kv_heads" axis must divide the kv
    head count K (not the K(G+2)H columns), "ffn" the feature count F, "vocab" the rows.
    A dimension the mesh axis does not divide is an error before anything compiles, unless
    ``ShardingRules(indivisible="replicate")``: then that dimension is replicated (logged),
    e.g. SmolLM2-135M's 3 kv heads on a model axis of 2, 4 or 8. No padding (but for
    ``exact``'s panels, below).
  * Two kinds of tensor parallelism. By default ``shard_params`` unpacks the CPU streaming
    matmul's packed weights (``kernels.packed``) into plain arrays, whose products GSPMD
    partitions Megatron-style; the partial sums over devices round differently from one
    device, so sampled tokens may part from one device's where a uniform draw falls within
    a last-bit difference of a boundary (greedy tokens agree wherever the argmax is no
    near-tie). ``ShardingRules(exact=True)`` instead keeps the packed weights and splits
    every one by output column panels: each device runs the kernel on its panels over the
    whole contraction and the activations are all-gathered after each product (``dense``),
    so every output element is computed as on one device, in the kernel's one summation
    order, and every mesh gives one device's bits (sampled tokens included). It reads the
    same weight bytes per device but all-gathers four activations a layer where Megatron
    all-reduces two, and it needs the kernel at every row count (``load_model(packed=True)``).
    Embedding tables stay split by rows (a lookup adds one row to zeros: exact), every other
    leaf is replicated, and panels are padded with zeros until the axis divides them.
  * The attention kernels (CPU FFI, Pallas) are custom calls GSPMD would gather around, so
    on a mesh they run under ``jax.shard_map`` on each device's rows and kv heads
    (``per_device``), and greedy tree verification's Pallas kernels on each device's rows.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from typing import Any, Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax import kv_cache as kvc
from specjax.config import ModelConfig
from specjax.kernels import streaming_matmul as sm
from specjax.kernels.packed import PROJECTIONS, PackedWeight, unpack_params
from specjax.kernels.packed import dense as packed_dense

DATA, MODEL = "data", "model"
LOGICAL_AXES = ("batch", "kv_heads", "ffn", "vocab", "embed", "columns")
INDIVISIBLE = ("error", "replicate")
_log = logging.getLogger("specjax")

# Logical axes of parameter leaves, by their key (the same names in targets and drafters).
PARAM_AXES: dict[str, tuple[Optional[str], ...]] = {
    "embed": ("vocab", "embed"),
    "input_embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "head": ("vocab", "embed"),  # drafters' [Vd, D] rows (Medusa's per-head [K, Vd, D]: none)
    "wqkv": ("embed", "kv_heads"),
    "bqkv": ("kv_heads",),
    "wo": ("kv_heads", "embed"),
    "w_gate_up": ("embed", "ffn"),
    "w_down": ("ffn", "embed"),
}
CACHE_AXES = ("batch", "kv_heads", None, None)  # KVCache.k/v [B, K, S, H]


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Which mesh axis each logical axis is split over (None: replicated).

  Attributes:
    axes: (logical axis, mesh axis or None) pairs; every logical axis of ``LOGICAL_AXES``
      not named is replicated.
    indivisible: "error" (default): a dimension its mesh axis does not divide is refused
      before compiling; "replicate": it is replicated instead, and logged.
    exact: False (default): Megatron-style tensor parallelism on plain weights (partial sums
      over devices, so a mesh rounds differently from one device). True: every mesh computes
      one device's bits (``shard_params`` keeps packed kernel weights, split by output
      column panels over the mesh axis of the logical axis "columns"; see ``dense``).

  Example: ``ShardingRules().with_axes(vocab=None)`` keeps the embedding and head whole.
  """

  axes: tuple[tuple[str, Optional[str]], ...] = (
      ("batch", DATA), ("kv_heads", MODEL), ("ffn", MODEL), ("vocab", MODEL), ("embed", None),
      ("columns", MODEL))
  indivisible: str = "error"
  exact: bool = False

  def __post_init__(self):
    names = [a for a, _ in self.axes]
    unknown = [a for a in names if a not in LOGICAL_AXES]
    if unknown or len(set(names)) != len(names):
      raise ValueError(f"sharding rules name unknown or repeated logical axes {unknown or names}; "
                       f"the logical axes are {LOGICAL_AXES}")
    if self.indivisible not in INDIVISIBLE:
      raise ValueError(f"indivisible must be one of {INDIVISIBLE}, got {self.indivisible!r}")

  def with_axes(self, **overrides: Optional[str]) -> "ShardingRules":
    """These rules with some logical axes mapped elsewhere (``vocab=None`` replicates it)."""
    table = dict(self.axes)
    table.update(overrides)
    return dataclasses.replace(self, axes=tuple(table.items()))

  def mesh_axis(self, logical: Optional[str]) -> Optional[str]:
    return dict(self.axes).get(logical) if logical else None

  def check_mesh(self, mesh) -> None:
    """Refuses rules naming a mesh axis the mesh lacks."""
    missing = sorted({m for _, m in self.axes if m is not None and m not in mesh.shape})
    if missing:
      raise ValueError(f"sharding rules map to mesh axes {missing}, but the mesh has axes "
                       f"{tuple(mesh.shape)}")


REPLICATED = ShardingRules(axes=tuple((a, None) for a in LOGICAL_AXES))


def make_mesh(data: int = 1, model: int = 1, devices: Optional[Sequence] = None) -> Mesh:
  """A ("data", "model") mesh of data × model devices (``jax.devices()`` by default).

  Raises ValueError when the mesh needs more devices than there are (8 simulated CPU
  devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
  """
  devices = list(jax.devices() if devices is None else devices)
  if data < 1 or model < 1:
    raise ValueError(f"mesh axes must be >= 1, got data={data}, model={model}")
  if data * model > len(devices):
    raise ValueError(f"a {data}x{model} mesh needs {data * model} devices, but only "
                     f"{len(devices)} are present ({devices[0].platform}); on CPU simulate more "
                     "with XLA_FLAGS=--xla_force_host_platform_device_count=N")
  auto = (jax.sharding.AxisType.Auto,) * 2
  return jax.make_mesh((data, model), (DATA, MODEL), axis_types=auto,
                       devices=devices[:data * model])


def _units(logical: Optional[str], dim: int, cfg: Optional[ModelConfig]) -> int:
  """How many indivisible units a dimension holds (kv heads, features, rows)."""
  if cfg is not None and logical == "kv_heads":
    return cfg.num_kv_heads
  if cfg is not None and logical == "ffn" and dim in (cfg.ffn_dim, 2 * cfg.ffn_dim):
    return cfg.ffn_dim
  return dim


def spec_for(shape: tuple[int, ...], logical: Sequence[Optional[str]], mesh_shape: dict,
             rules: ShardingRules, cfg: Optional[ModelConfig] = None, what: str = "") -> P:
  """The PartitionSpec of an array of ``shape`` with logical axes ``logical``.

  Raises ValueError where a mesh axis does not divide its dimension (rules.indivisible
  "error"); with "replicate" that dimension is replicated.
  """
  out = []
  for dim, name in zip(shape, logical):
    axis = rules.mesh_axis(name)
    size = mesh_shape.get(axis, 1) if axis else 1
    units = _units(name, dim, cfg)
    if size > 1 and units % size:
      unit = {"kv_heads": "kv heads", "ffn": "ffn features", "batch": "rows",
              "vocab": "vocabulary rows"}.get(name, "entries")
      if rules.indivisible == "error" or name == "batch":
        raise ValueError(f"{what or 'an array'}: the {axis!r} mesh axis ({size}) does not divide "
                         f"its {units} {unit} (logical axis {name!r}); choose a mesh axis that "
                         "divides it, map the axis elsewhere (ShardingRules.with_axes), or "
                         "ShardingRules(indivisible='replicate')")
      _log.info("specjax sharding: %s: %d %s not divisible by %r (%d): replicated", what,
                units, unit, axis, size)
      axis = None
    out.append(axis if size > 1 else None)
  return P(*out)


def _key_name(path) -> str:
  for entry in reversed(path):
    if isinstance(entry, jax.tree_util.DictKey):
      return str(entry.key)
  return ""


def param_specs(params: Any, cfg: Optional[ModelConfig], mesh,
                rules: ShardingRules = ShardingRules()) -> Any:
  """A PartitionSpec per leaf of a parameter pytree (target or drafter), by its key name
  (``PARAM_AXES``); leaves without a rule, and non-floating leaves, are replicated."""
  rules.check_mesh(mesh)

  def spec(path, x):
    name = _key_name(path)
    axes = PARAM_AXES.get(name)
    if axes is None or len(axes) != np.ndim(x) or not np.issubdtype(x.dtype, np.floating):
      return P()
    return spec_for(x.shape, axes, dict(mesh.shape), rules, cfg, jax.tree_util.keystr(path))

  return jax.tree_util.tree_map_with_path(spec, params)


def _unpack(params: Any, cfg: Optional[ModelConfig], drafter) -> Any:
  """Plain arrays for packed CPU weights: a drafter's by its own ``plain_params``, a target's
  by ``kernels.packed.unpack_params``; any packed leaf left is refused, not guessed."""
  if drafter is not None:
    params = drafter.plain_params(params)
  elif cfg is not None and isinstance(params, dict) and "layers" in params:
    params = unpack_params(params, cfg.tie_embeddings)
  packed = [jax.tree_util.keystr(p) for p, w in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda w: isinstance(w, PackedWeight))[0] if isinstance(w, PackedWeight)]
  if packed:
    raise ValueError(f"{packed[0]} is a packed CPU weight this module cannot unpack without "
                     "its drafter: shard_params(..., drafter=drafter)")
  return params


def shard_params(params: Any, cfg: Optional[ModelConfig], mesh,
                 rules: ShardingRules = ShardingRules(), *, drafter=None) -> Any:
  """``params`` placed on ``mesh`` by ``param_specs``. Packed CPU weights are unpacked first
  (Megatron-style products on plain weights): a target's by this module, a drafter's by
  ``drafter.plain_params`` (pass ``drafter=`` for draft params). With ``rules.exact`` they
  stay packed instead, split by output column panels (``_shard_exact``)."""
  if rules.exact:
    return _shard_exact(params, mesh, rules, target=drafter is None)
  params = _unpack(params, cfg, drafter)
  specs = param_specs(params, cfg, mesh, rules)
  return jax.tree.map(lambda x, s: place(x, NamedSharding(mesh, s)), params, specs)


# Leaves ``rules.exact`` splits by rows: lookup tables, whose sharded gather adds each row to
# zeros from the other devices (exact), never contracted against on that path.
_LOOKUP_TABLES = ("embed", "input_embed")


def _shard_exact(params: Any, mesh, rules: ShardingRules, target: bool = True) -> Any:
  """``shard_params`` under ``rules.exact``: every packed weight's panels split over the mesh
  axis of "columns" (zero panels appended until the axis divides them: extra output columns,
  cut off by ``dense``), embedding tables by vocabulary rows, everything else replicated.

  Raises ValueError for a packed weight whose policy takes XLA's dot at some row count, and
  for a plain projection or output head of a ``target`` (``SPECJAX_MATMUL=xla``): it would
  be replicated whole on every device, which is not tensor parallelism. A drafter's plain
  leaves (a small draft model's, Medusa's blocks) are replicated: exact, at full size."""
  rules.check_mesh(mesh)
  axis = rules.mesh_axis("columns")
  size = dict(mesh.shape).get(axis, 1) if axis else 1

  def put(path, x):
    where = jax.tree_util.keystr(path)
    if isinstance(x, PackedWeight):
      if not x.policy.always:
        raise ValueError(f"{where}: exact sharding runs the streaming kernel at every row "
                         f"count, but this weight was packed under {x.policy.describe()}; "
                         "load the model with load_model(packed=True) (SPECJAX_MATMUL=kernel)")
      panels = np.asarray(x.panels)
      pad = -panels.shape[0] % size
      if pad:
        panels = np.concatenate([panels, np.zeros((pad,) + panels.shape[1:], panels.dtype)])
      spec = P(axis if size > 1 else None, None, None)
      return dataclasses.replace(x, panels=place(panels, NamedSharding(mesh, spec)), plain=None)
    name = _key_name(path)
    if target and name in PROJECTIONS + ("lm_head",) and np.ndim(x) == 2:
      raise ValueError(f"{where}: exact sharding splits packed kernel weights, but this one "
                       "is a plain matrix; load the model with load_model(packed=True) "
                       "(not SPECJAX_MATMUL=xla), or use ShardingRules(exact=False)")
    spec = P()
    if name in _LOOKUP_TABLES and np.ndim(x) == 2 and np.issubdtype(x.dtype, np.floating):
      spec = spec_for(x.shape, PARAM_AXES[name], dict(mesh.shape), rules, None, where)
    return place(x, NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(put, params,
                                          is_leaf=lambda x: isinstance(x, PackedWeight))


def dense(x: jax.Array, w: Any) -> jax.Array:
  """``kernels.packed.dense`` (x [..., K] @ w [K, N]), and on a mesh of more than one device
  a packed weight's kernel products per device (``_per_device_kernel``): the result does not
  depend on the mesh. Plain weights and the row counts a packed weight's policy gives to
  XLA's dot are partitioned by GSPMD."""
  if isinstance(w, PackedWeight) and multi_device():
    return packed_dense(x, w, kernel=_per_device_kernel)
  return packed_dense(x, w)


def _per_device_kernel(x: jax.Array, w: PackedWeight) -> jax.Array:
  """x [M, K] @ packed ``w`` on the active mesh: each device multiplies its rows (over
  "batch") by its column panels (over "columns") with the streaming kernel over the whole K,
  and the outputs are all-gathered over the columns' axis (inside ``jax.shard_map``: GSPMD
  would gather the weight itself around a custom call). Every output element is computed as
  on one device. Rows or panels the axis does not divide stay whole on each device."""
  mesh, rules = _active_or_abstract()
  row_axis = _dividing_axis(mesh, rules, "batch", x.shape[0])
  col_axis = _dividing_axis(mesh, rules, "columns", w.panels.shape[0])

  def local(xs, panels):
    y = sm.streaming_matmul(xs, panels, prefetch=w.policy.prefetch_at(xs.shape[0]))
    return jax.lax.all_gather(y, col_axis, axis=1, tiled=True) if col_axis else y

  return jax.shard_map(local, mesh=mesh, in_specs=(P(row_axis, None), P(col_axis, None, None)),
                       out_specs=P(row_axis, None), check_vma=False)(x, w.panels)


def place(x: Any, where: NamedSharding) -> jax.Array:
  """``x`` (the same global value on every process) as a global array laid out by
  ``where``; each process supplies only its own devices' pieces (``jax.distributed``)."""
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, where, lambda index: host[index])


def to_host(x: Any) -> np.ndarray:
  """A numpy copy of a (possibly global, multi-process) array: pieces other processes
  hold are gathered (``multihost_utils.process_allgather``); everything else as ``np.asarray``."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def shard_batch(batch: Any, mesh, rules: ShardingRules = ShardingRules()) -> Any:
  """A batch-major pytree (training batches: [B, ...] arrays) with its rows over the
  "batch" logical axis, the rest of each array whole."""
  def put(x):
    host = to_host(x)
    spec = spec_for(host.shape[:1], ("batch",), dict(mesh.shape), rules, what="the batch")
    return place(host, NamedSharding(mesh, spec))
  return jax.tree.map(put, batch)


# ------------------------------------------------------------------ the active mesh

_ACTIVE: contextvars.ContextVar[Optional[tuple[Mesh, ShardingRules]]] = contextvars.ContextVar(
    "specjax_mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: ShardingRules = ShardingRules()):
  """Runs the enclosed decoding on ``mesh`` under ``rules`` (``jax.set_mesh`` as well)."""
  rules.check_mesh(mesh)
  token = _ACTIVE.set((mesh, rules))
  try:
    with jax.set_mesh(mesh):
      yield mesh
  finally:
    _ACTIVE.reset(token)


def active() -> Optional[tuple[Mesh, ShardingRules]]:
  """(mesh, rules) inside ``use_mesh``, else None."""
  return _ACTIVE.get()


def multi_device() -> bool:
  """Whether a mesh of more than one device is active (``use_mesh`` or ``jax.set_mesh``)."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and mesh.size > 1


def _active_or_abstract() -> tuple[Any, ShardingRules]:
  """(mesh, rules) of ``use_mesh``, else ``jax.set_mesh``'s abstract mesh and default rules."""
  return active() or (jax.sharding.get_abstract_mesh(), ShardingRules())


def _dividing_axis(mesh, rules: ShardingRules, logical: str, n: int) -> Optional[str]:
  """The mesh axis ``rules`` give ``logical`` where it has more than one device and divides
  ``n``; else None (whole on every device)."""
  m = rules.mesh_axis(logical)
  size = dict(mesh.shape).get(m, 1) if m else 1
  return m if size > 1 and n % size == 0 else None


def per_device(fn, args: Sequence[Any], logical: Sequence[Sequence[Optional[str]]],
               out_logical: Union[Sequence[Optional[str]], tuple[Sequence[Optional[str]], ...]],
               sizes: dict[str, int]) -> Any:
  """``fn(*args)``, run on each device's shards (``jax.shard_map``) under a mesh of more than
  one device: how a custom call (the CPU and Pallas kernels) runs on a mesh, since GSPMD
  cannot partition it and would gather its operands whole.

  Args:
    fn: computes on local blocks; it must need no communication (e.g. attention of local
      rows over local kv heads).
    args: the arrays.
    logical, out_logical: each arg's and the output's logical axes (None: whole); where
      ``fn`` returns a tuple of arrays (a tuple, not a list), ``out_logical`` is a tuple
      of their axes, e.g. ``(("batch", None), ("batch",))``.
    sizes: each logical axis's size. An axis goes to its mesh axis (by the active rules)
      where that divides the size, else stays whole on every device, for every operand
      alike (so e.g. 3 kv heads on a model axis of 2 are computed whole on each device).

  Outside a mesh, or on one device, it is ``fn(*args)``.
  """
  if not multi_device():
    return fn(*args)
  mesh, rules = _active_or_abstract()
  axis = {name: _dividing_axis(mesh, rules, name, n) for name, n in sizes.items()}
  spec = lambda names: P(*(axis.get(n) for n in names))
  several = bool(out_logical) and isinstance(out_logical[0], (tuple, list))
  out_specs = tuple(spec(o) for o in out_logical) if several else spec(out_logical)
  return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(l) for l in logical),
                       out_specs=out_specs, check_vma=False)(*args)


def check_batch(batch_size: int, mesh=None, rules: Optional[ShardingRules] = None) -> None:
  """Refuses (before compiling) a batch the data axis does not divide: on ``mesh`` under
  ``rules`` when given, else inside ``use_mesh`` on the active mesh, else never."""
  if mesh is None:
    current = active()
    if current is None:
      return
    mesh, rules = current
  spec_for((batch_size,), ("batch",), dict(mesh.shape), rules or ShardingRules(),
           what="the batch")


def state_specs(tree: Any, batch_size: int, mesh_shape: dict, rules: ShardingRules,
                cfg: Optional[ModelConfig] = None) -> Any:
  """PartitionSpecs of a decoding state: KV caches [B, K, S, H] by ``CACHE_AXES``; every
  other array whose leading axis has the batch size is batch-major (rows on "batch"); the
  rest (step counters, keys) replicated."""

  def cache(c: kvc.KVCache):
    kv = lambda a: spec_for(a.shape, CACHE_AXES, mesh_shape, rules,
                            None, "a KV cache") if a.ndim == 4 else P()
    return c.replace(k=tuple(kv(a) for a in c.k), v=tuple(kv(a) for a in c.v),
                     lengths=spec_for(c.lengths.shape, ("batch",), mesh_shape, rules))

  def leaf(x):
    if isinstance(x, kvc.KVCache):
      return cache(x)
    if np.ndim(x) >= 1 and x.shape[0] == batch_size:
      return spec_for(x.shape[:1], ("batch",), mesh_shape, rules)
    return P()

  return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, kvc.KVCache))


def constrain(tree: Any, batch_size: int, replicate_rows: bool = False) -> Any:
  """Inside ``use_mesh`` (at trace time): ``tree`` pinned to ``state_specs`` with
  ``with_sharding_constraint``; elsewhere ``tree`` itself. ``replicate_rows``: the rows
  are on every data shard (e.g. one request's prefill, which the data axis cannot
  split), the other axes (caches' kv heads) by the rules."""
  current = active()
  if current is None or not multi_device():
    return tree
  mesh, rules = current
  if replicate_rows:
    rules = rules.with_axes(batch=None)
  specs = state_specs(tree, batch_size, dict(mesh.shape), rules)
  return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, s), tree, specs,
                      is_leaf=lambda x: isinstance(x, P))
