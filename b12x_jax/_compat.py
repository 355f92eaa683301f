"""Every private JAX API b12x_jax touches, in one place.

Each helper says which JAX versions it was checked on and when it can go.
The package declares jax>=0.11.2,<0.13; CI runs the tests on jax 0.11.2 and
on the newest 0.12.x (.ci/run). Checked on 0.11.2 and 0.12.0.1, every helper
here takes the same branch on both: where a release differs, the helper
branches on it, with a comment naming the releases of each branch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def drop_varying_axis(aval, axis_name: str):
  """``aval`` with ``axis_name`` removed from its varying manual axes: the
  output of a sum over the axis is the same on every rank, as for psum.

  jax 0.11 and 0.12 keep varying axes in ``aval.mat.varying`` (avals without
  ``mat``, tokens, are returned as they are). Goes when JAX exposes a public
  cast to invariant.
  """
  mat = getattr(aval, "mat", None)
  if mat is None:
    return aval
  return aval.update(manual_axis_type=mat.update(varying=frozenset(a for a in mat.varying if a != axis_name)))


def shape_dtype_like(x, shape: tuple[int, ...] | None = None):
  """A ``jax.ShapeDtypeStruct`` of traced ``x``'s shape (or ``shape``),
  dtype and manual axis type (what ``pallas_call`` under shard_map with
  check_vma needs for an output that varies as ``x`` does). jax 0.11 and
  0.12 keep it in ``aval.mat``."""
  import jax
  aval = jax.typeof(x)
  return jax.ShapeDtypeStruct(aval.shape if shape is None else shape, aval.dtype,
                              manual_axis_type=getattr(aval, "mat", None))


def varying_axes(aval) -> frozenset:
  """The manual mesh axes ``aval`` varies over (the field of
  ``drop_varying_axis``); empty for avals without it."""
  mat = getattr(aval, "mat", None)
  return frozenset() if mat is None else frozenset(mat.varying)


def add_varying_axes(aval, axes):
  """``aval`` varying over ``axes`` too: the output of an op that gives each
  rank its own shard (dcp_a2a) differs across the axis, whatever the inputs;
  the fused op's results vary where its residual does. Goes with
  ``drop_varying_axis``."""
  mat = getattr(aval, "mat", None)
  if mat is None:
    return aval
  return aval.update(manual_axis_type=mat.update(varying=frozenset(mat.varying) | frozenset(axes)))


def axis_device_groups(ctx, axis_name: str) -> list[tuple]:
  """The device groups of a mesh axis, from a lowering context inside
  ``shard_map``: one tuple per position of the other axes, devices in the
  order of ``axis_index``.

  Reads ``ctx.module_context.axis_context`` (a ``SPMDAxisContext`` on jax
  0.11 and 0.12). When shard_map was given an abstract mesh, its devices are the
  module's device assignment in mesh order.
  """
  axis_context = ctx.module_context.axis_context
  mesh = getattr(axis_context, "mesh", None)
  if mesh is None:
    raise ValueError(
        f"axis {axis_name!r} is not a shard_map mesh axis in this lowering "
        "(b12x_jax collectives run inside jax.shard_map)")
  names = tuple(mesh.axis_names)
  if axis_name not in names:
    raise ValueError(f"axis {axis_name!r} is not one of the mesh axes {names}")
  along = np.moveaxis(_devices_of(ctx, mesh), names.index(axis_name), -1)
  return [tuple(row) for row in along.reshape(-1, along.shape[-1])]


def mesh_devices(ctx) -> tuple[tuple[str, ...], np.ndarray]:
  """(axis names, devices in mesh order) of the shard_map mesh of a
  lowering context: what ``axis_device_groups`` reads, for a lowering
  that picks a per-device constant by the device's mesh position
  (``jax.lax.axis_index`` over every axis, row-major). Checked on jax
  0.11.2 and 0.12.0.1."""
  mesh = ctx.module_context.axis_context.mesh
  return tuple(mesh.axis_names), _devices_of(ctx, mesh)


_MESH_DEVICES_KEY = ("b12x_jax", "devices of abstract meshes")


def _devices_of(ctx, mesh) -> np.ndarray:
  """The devices of a shard_map's ``mesh`` in mesh order: its own, or, for
  an abstract mesh (``mesh=mesh.abstract_mesh``, a nested shard_map), those
  ``order_shard_maps`` found around the shard_map."""
  import jax
  if isinstance(mesh, jax.sharding.Mesh):
    return np.asarray(mesh.devices, dtype=object)
  found = ctx.module_context.cached_primitive_lowerings.get(_MESH_DEVICES_KEY, {}).get(mesh)
  if found is None:
    raise ValueError(f"the devices of the shard_map's abstract mesh {mesh} are unknown here: pass "
                     "jax.shard_map a concrete mesh (mesh=jax.make_mesh(...)), or leave mesh= out inside "
                     "`with jax.set_mesh(mesh):`")
  return found


def _note_abstract_mesh_devices(ctx, mesh) -> None:
  """For a shard_map over an abstract mesh with b12x calls: its devices,
  those of the enclosing shard_map's mesh of the same axes (a nested
  shard_map takes the context's abstract mesh), for ``_devices_of``. No
  other source: a flat device assignment does not say the mesh's order, and
  a group in the wrong order sums with the wrong peers. Checked on jax
  0.11.2 and 0.12.0.1."""
  import jax
  if isinstance(mesh, jax.sharding.Mesh):
    return
  known = ctx.module_context.cached_primitive_lowerings.setdefault(_MESH_DEVICES_KEY, {})
  outer_mesh = getattr(ctx.module_context.axis_context, "mesh", None)
  if outer_mesh is None or tuple(outer_mesh.axis_names) != tuple(mesh.axis_names) or \
      tuple(outer_mesh.axis_sizes) != tuple(mesh.axis_sizes):
    return
  devices = _devices_of(ctx, outer_mesh) if isinstance(outer_mesh, jax.sharding.Mesh) else known.get(outer_mesh)
  if devices is not None:
    known[mesh] = devices


def lowering_for_export(ctx) -> bool:
  """Whether ``ctx`` lowers a module for ``jax.export`` (serializable, to
  run in another process). Checked on jax 0.11.2 and 0.12.0.1."""
  return bool(getattr(ctx.module_context.lowering_parameters, "for_export", False))


def device_ordinal(device) -> int:
  """The ordinal XLA passes to FFI handlers as ``DeviceOrdinal`` for this
  process's ``device``: on GPUs its local hardware id (the CUDA ordinal in
  this process), on CPU its global id, which is not its local index in a
  multi-process run (process 1's first CPU device is id 2048). Checked on
  jax 0.11.2 and 0.12.0.1, one process and jax.distributed."""
  ordinal = getattr(device, "local_hardware_id", None)
  return int(device.id if ordinal is None or device.platform == "cpu" else ordinal)


def platform_of(devices: Sequence) -> str:
  """'cpu', 'cuda', 'rocm' or another XLA platform name of a device group.
  JAX reports both GPU platforms as 'gpu'; the client's version tells them
  apart."""
  platforms = {d.platform for d in devices}
  if len(platforms) != 1:
    raise ValueError(f"a device group spans several platforms: {sorted(platforms)}")
  platform = platforms.pop()
  if platform != "gpu":
    return platform
  version = str(getattr(devices[0].client, "platform_version", "")).lower()
  return "rocm" if "rocm" in version else "cuda"


# -- jax.distributed key-value store (docs/DESIGN.md, "Transports") ----------------------------------
# jax 0.11 and 0.12 reach the coordination service's key-value store only through the
# private client in ``jax._src.distributed.global_state``. These go when JAX
# exposes a public key-value API.


def distributed_client():
  """The ``jax.distributed`` client of this process, or None before
  ``jax.distributed.initialize`` (checked on jax 0.11.2 and 0.12.0.1)."""
  from jax._src import distributed
  return distributed.global_state.client


def kv_set_bytes(key: str, value: bytes, *, overwrite: bool = False) -> None:
  """Publishes ``value`` under ``key``; a key is written once unless ``overwrite``."""
  distributed_client().key_value_set_bytes(key, value, allow_overwrite=overwrite)


def kv_set_first(key: str, value: bytes) -> bytes | None:
  """Publishes ``value`` under ``key`` unless some process published there
  first: None where ``value`` is now the key's, else the value that was
  (the store decides, so every process sees one value per key)."""
  try:
    distributed_client().key_value_set_bytes(key, value, allow_overwrite=False)
    return None
  except RuntimeError as e:
    if "ALREADY_EXISTS" not in str(e):
      raise
  held = kv_try_get_bytes(key)
  if held is None:  # keys are never deleted
    raise RuntimeError(f"b12x_jax: key {key!r} exists and cannot be read")
  return held


def kv_try_get_bytes(key: str) -> bytes | None:
  """The value of ``key`` now, or None if nobody published it."""
  try:
    return distributed_client().key_value_try_get_bytes(key)
  except RuntimeError:  # the client raises NOT_FOUND
    return None


def kv_get_bytes(key: str, timeout_s: float) -> bytes | None:
  """The value of ``key`` once some process published it, or None if none
  did within ``timeout_s`` (the client raises a runtime error then)."""
  try:
    return distributed_client().blocking_key_value_get_bytes(key, max(1, int(timeout_s * 1000)))
  except RuntimeError:
    return None


# -- the order of a channel's calls (docs/DESIGN.md, "Call order") ------------------
# jax 0.11 and 0.12 keep effect registries, named-axis effects and the lowering
# of shard_map in private modules (``jax._src.effects``, ``core``, ``shard_map``,
# ``interpreters.mlir``). Go when JAX exposes a public way to order custom calls
# inside a program without an effect on its executable.


def with_weak_type(x, weak_type: bool):
  """Traced ``x`` with its dtype and the weak type ``weak_type``. jax 0.11
  and 0.12 set it only in ``lax._convert_element_type``; goes when
  ``jax.lax.convert_element_type`` takes it."""
  import jax
  if jax.typeof(x).weak_type == weak_type:
    return x
  from jax._src.lax import lax
  return lax._convert_element_type(x, weak_type=weak_type)


def axis_effect_base() -> type:
  """``core.NamedAxisEffect``: an effect named by a mesh axis, which
  ``jax.shard_map`` drops from its own effects (``core.filter_named_axis_effects``
  over the mesh's axis names), so nothing outside the shard_map carries it."""
  from jax._src import core
  return core.NamedAxisEffect


def register_ordered_effect(effect_type: type) -> None:
  """Makes ``effect_type`` (a named-axis effect) ordered: JAX threads one
  token per effect through the calls that have it, into and out of control
  flow, nested jit, checkpoint and custom derivatives (where named-axis
  effects are allowed already); ``order_shard_maps`` makes and ends the
  token inside each shard_map."""
  from jax._src import effects
  effects.ordered_effects.add_type(effect_type)
  order_shard_maps(effect_type)
  inline_jits_of_ordered_shard_maps(effect_type)


def order_shard_maps(effect_type: type) -> None:
  """Wraps shard_map's lowering so that a body whose calls carry an
  ``effect_type`` of one of the mesh's axes gets that effect's token.

  JAX drops such an effect from the shard_map equation, so the enclosing
  function has no token of it to pass: the shard_map makes one, and its
  token out is kept for the next shard_map lowered into the same block of
  the same module (two shard_maps one after the other chain their calls, as
  calls in one body do); it ends there, unused, so no token leaves the
  module. The chain between shard_maps is the channel's (``effect.channel``),
  whatever the axis: two meshes may name the same devices differently, and
  their calls on one channel share its memory. A body's effects of one
  channel (two axes of a mesh) start from its token and are joined after.
  Checked on jax 0.11.2 and 0.12.0.1 (shardy and GSPMD lowerings both read
  the body's tokens from ``ctx.tokens_in``)."""
  from jax._src import shard_map
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir.dialects import hlo
  entry = mlir._lowerings[shard_map.shard_map_p]
  inner = entry.rule

  def rule(ctx, *in_nodes, jaxpr, mesh, **params):
    axes = set(mesh.axis_names)
    own = [e for e in jaxpr.effects if isinstance(e, effect_type) and e.name in axes]
    if not own:
      return inner(ctx, *in_nodes, jaxpr=jaxpr, mesh=mesh, **params)
    _note_abstract_mesh_devices(ctx, mesh)
    chains = _block_chains(ctx)
    starts = {channel: chains.take(channel) for channel in sorted({e.channel for e in own})}
    tokens = {e: starts[e.channel] for e in own}
    sub = ctx.replace(tokens_in=mlir.TokenSet({**dict(ctx.tokens_in.items()), **tokens}))
    outs = inner(sub, *in_nodes, jaxpr=jaxpr, mesh=mesh, **params)
    passed, ends = {}, {}
    for e, token in (sub.tokens_out.items() if sub.tokens_out is not None else ()):
      if e in tokens:
        ends.setdefault(e.channel, []).append(token)
      else:
        passed[e] = token
    for channel, end in ends.items():
      chains.keep(channel, end[0] if len(end) == 1 else hlo.after_all(end))
    ctx.set_tokens_out(mlir.TokenSet(passed))
    return outs

  # Uncacheable: a cached lowering would run in a function of its own, not in
  # the block of the shard_maps beside it, and once for equal shard_maps.
  mlir.register_lowering(shard_map.shard_map_p, rule, inline=entry.inline, cacheable=False)


def inline_jits_of_ordered_shard_maps(effect_type: type) -> None:
  """Wraps jit's lowering so that a jitted function whose body holds a
  shard_map with calls of an ``effect_type`` lowers into the block of its
  caller instead of as a function of its own: there its shard_maps chain
  with the caller's (``order_shard_maps``). As a function, every call of it
  would start a chain of its own, so two calls of one jitted layer would
  leave its collectives unordered, with equal tags (docs/DESIGN.md, "Call
  order"). A jit with shardings, layouts or compiler options of its own
  keeps JAX's lowering (it would lose them inlined). Checked on jax 0.11.2
  and 0.12.0.1."""
  from jax._src import pjit, shard_map, sharding_impls
  from jax._src.interpreters import mlir
  entry = mlir._lowerings[pjit.jit_p]
  inner = entry.rule

  def holds_chain(jaxpr, seen: dict) -> bool:  # seen: answers by jaxpr, for this module's lowering
    if id(jaxpr) not in seen:
      seen[id(jaxpr)] = any(
          (eqn.primitive is shard_map.shard_map_p and any(isinstance(e, effect_type)
                                                          for e in eqn.params["jaxpr"].effects))
          or any(holds_chain(sub, seen) for sub in _subjaxprs(eqn)) for eqn in jaxpr.eqns)
    return seen[id(jaxpr)]

  def plain(shardings, layouts) -> bool:
    return (all(isinstance(s, sharding_impls.UnspecifiedValue) for s in shardings)
            and all(layout is None for layout in layouts))

  def rule(ctx, *args, jaxpr, in_shardings, out_shardings, in_layouts, out_layouts, compiler_options_kvs,
           **params):
    seen = ctx.module_context.cached_primitive_lowerings.setdefault(("b12x_jax", "jaxprs with chains"), {})
    if (compiler_options_kvs or not plain(in_shardings, in_layouts) or not plain(out_shardings, out_layouts)
        or not holds_chain(jaxpr.jaxpr, seen)):
      return inner(ctx, *args, jaxpr=jaxpr, in_shardings=in_shardings, out_shardings=out_shardings,
                   in_layouts=in_layouts, out_layouts=out_layouts, compiler_options_kvs=compiler_options_kvs,
                   **params)
    consts = mlir.ir_consts(jaxpr.consts, [v.aval for v in jaxpr.jaxpr.constvars])
    outs, tokens = mlir.jaxpr_subcomp(ctx.module_context, jaxpr.jaxpr, ctx.name_stack.extend(params["name"]),
                                      ctx.tokens_in, consts, *args, dim_var_values=ctx.dim_var_values,
                                      const_lowering=ctx.const_lowering, outer_traceback=ctx.traceback)
    ctx.set_tokens_out(tokens)
    return outs

  mlir.register_lowering(pjit.jit_p, rule, inline=entry.inline, cacheable=False)  # as JAX registers it


def _subjaxprs(eqn) -> list:
  """The jaxprs (open) in the params of ``eqn``: bodies of control flow,
  nested jits, shard_maps and custom derivatives."""
  from jax.extend.core import jaxprs_in_params
  return [getattr(j, "jaxpr", j) for j in jaxprs_in_params(eqn.params)]


class _BlockChains:
  """The last token of each channel's chain per block of one module being
  lowered, kept in the module context's ``cached_primitive_lowerings``,
  which every context of one module's lowering shares and which goes with
  it."""

  def __init__(self):
    self._last: list[tuple] = []  # (block, channel, token)

  def take(self, channel: str):
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo
    block = ir.InsertionPoint.current.block
    for i, (b, c, token) in enumerate(self._last):
      if c == channel and b == block:
        del self._last[i]
        return token
    return hlo.create_token()

  def keep(self, channel: str, token) -> None:
    from jax._src.lib.mlir import ir
    self._last.append((ir.InsertionPoint.current.block, channel, token))


_CHAINS_KEY = ("b12x_jax", "block chains")


def _block_chains(ctx) -> _BlockChains:
  return ctx.module_context.cached_primitive_lowerings.setdefault(_CHAINS_KEY, _BlockChains())


def abstract_token():
  """The abstract value of an XLA token."""
  from jax._src import core
  return core.abstract_token


def optimization_barrier(values: list) -> list:
  """``values`` (MLIR values, tokens included) through one
  stablehlo.optimization_barrier, for a lowering rule: XLA moves nothing
  across it, nor fuses into it. jax 0.11 has no public builder for it."""
  from jax._src.lib.mlir.dialects import hlo
  return list(hlo.OptimizationBarrierOp(values).results)


def vmap_axis_names() -> frozenset:
  """The axis names that enclosing ``jax.vmap(..., axis_name=...)`` traces
  of the current trace bind (its chain of parent traces). A name here that
  is also a mesh axis names the vmap axis, as it does for psum."""
  from jax._src import core
  from jax._src.interpreters import batching
  names, trace = set(), core.trace_ctx.trace
  while trace is not None:
    if isinstance(trace, batching.BatchTrace) and trace.axis_data.name is not None:
      names.add(trace.axis_data.name)
    trace = getattr(trace, "parent_trace", None)
  return frozenset(names)


def automatic_axes() -> tuple[str, ...]:
  """The mesh axes that the enclosing jax.shard_map leaves to the
  partitioner (its ``axis_names`` a subset of the mesh's), in mesh order;
  empty outside one."""
  import jax
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(mesh.manual_axes)
  return tuple(name for name in mesh.axis_names if name not in manual)


def manual_axes() -> frozenset:
  """The mesh axes the enclosing jax.shard_map makes manual (empty outside
  one); a vmap axis name is not among them. Read from
  ``jax.sharding.get_abstract_mesh()`` (jax 0.11 and 0.12)."""
  import jax
  return frozenset(jax.sharding.get_abstract_mesh().manual_axes)
