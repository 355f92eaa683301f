"""What every op module shares: the axis check, and the lowering and
registration of a b12x primitive (its channel's order token included)."""

from __future__ import annotations

import functools
import os
import sys
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from b12x_jax import _compat, _native
from b12x_jax.channels import channel_order
from b12x_jax.communicator import get_communicator, partition_key
from b12x_jax.errors import ChannelError


def as_array(op: str, arg: str, x, what: str = "an array") -> jax.Array:
  """``x`` as a jax array, or a TypeError naming the op and the argument:
  ``x`` is not an array, or one of no number type (strings, objects, an
  abstract ShapeDtypeStruct)."""
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"b12x_jax.{op}: {arg} must be {what}, got {type(x).__name__}")
  try:
    return jnp.asarray(x)
  except TypeError:
    raise TypeError(f"b12x_jax.{op}: {arg} must be {what} of numbers, got {type(x).__name__} of dtype "
                    f"{x.dtype}") from None


def axis_size(axis_name: str, op: str) -> int:
  """The size of a bound mesh axis, or a ValueError that says how to bind it."""
  if not isinstance(axis_name, str):
    raise TypeError(f"b12x_jax.{op}: axis_name must be one mesh axis name (a str), got {axis_name!r}")
  try:
    return jax.lax.axis_size(axis_name)
  except (NameError, KeyError, ValueError) as e:
    raise ValueError(
        f"b12x_jax.{op}: unknown axis_name {axis_name!r}: call it inside jax.shard_map over a mesh with "
        f"that axis ({e})") from None


# Code whose frames are no call site of the user's: this package, JAX's.
_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                 os.path.dirname(os.path.abspath(jax.__file__)) + os.sep)


def _in_library(frame) -> bool:
  return os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS)


def call_site(op: str) -> int:
  """The site of the call of ``op`` being traced (ffi/channel.h CallTag):
  a 31-bit hash of the user's frames from the call out to the innermost JAX
  transformation tracing it (file name, line, function), so calls at
  different places of a program, or of different programs, differ, and
  every process that traces the same code computes the same. Frames above
  that transformation (who traced the function, from where) do not count:
  processes may trace one program from different places. Named in this
  process's error messages."""
  frame = sys._getframe(1)
  while frame is not None and _in_library(frame):
    frame = frame.f_back
  frames = []
  while frame is not None and not _in_library(frame):
    code = frame.f_code
    frames.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_qualname}")
    frame = frame.f_back
  name = f"{op} at {' < '.join(frames) or 'a call from JAX'}"
  site = zlib.crc32(name.encode()) & 0x7FFFFFFF
  _native.name_site(site, name)
  return site


MAX_BLOCKS = _native.MAX_BLOCKS  # largest grid of a channel


def channel_blocks(max_blocks: int | None) -> int:
  """The blocks a channel gets, as the native layer resolves them: on GPUs
  (cuda_channel.cu, resolve_max_blocks) the Communicator's max_blocks, else
  min(64, the SM count of the smallest visible GPU); without one, the host
  backend's single block (cpu/host_channel.cc)."""
  try:
    sms = [getattr(d, "core_count", MAX_BLOCKS) for d in jax.devices("gpu")]
  except RuntimeError:
    return 1
  return max_blocks if max_blocks is not None else min([MAX_BLOCKS, *sms])


def why_not_a_mesh_axis(axis_name: str) -> tuple[str, str] | None:
  """(reason, fix) where ``axis_name`` is bound but is no mesh axis of the
  enclosing jax.shard_map (a ``vmap(..., axis_name=...)`` name, also one
  that shadows a mesh axis of the same name): a channel is one group of
  devices, which only a mesh axis names; or where that shard_map leaves
  other axes automatic. None for a mesh axis of a fully manual shard_map."""
  fix = "Use a mesh axis of the enclosing jax.shard_map"
  if axis_name not in _compat.manual_axes():
    return f"axis {axis_name!r} is not a jax.shard_map mesh axis here (a vmap axis name?)", fix
  if axis_name in _compat.vmap_axis_names():
    return f"axis {axis_name!r} names a jax.vmap axis here, which shadows the mesh axis of that name", fix
  automatic = _compat.automatic_axes()
  if automatic:  # a custom call has no partitioning rule: XLA gathers the operand over them, or aborts
    return (f"the enclosing jax.shard_map leaves mesh axes {automatic} to the partitioner, which cannot split "
            f"a b12x call over them", "Make every mesh axis manual (jax.shard_map without axis_names)")
  return None


def why_not_concrete(arg: str, x: jax.Array) -> tuple[str, str] | None:
  """(reason, fix) where ``x`` has a symbolic dimension (jax.export's shape
  polymorphism): a channel plans each call from its sizes at trace time,
  so only the fallback can run it. None for a concrete shape."""
  if all(isinstance(d, (int, np.integer)) for d in x.shape):
    return None
  return (f"{arg} has a symbolic shape [{', '.join(map(str, x.shape))}] (jax.export shape polymorphism); a b12x "
          f"call is planned for concrete sizes", "Export with concrete shapes (one export per size) for b12x")


def empty_result(shape: tuple[int, ...], dtype, axes) -> jax.Array:
  """An empty result of a collective that runs none (XLA:CPU segfaults
  compiling an empty collective beside another one): zeros of ``shape`` and
  ``dtype`` varying over the mesh ``axes``, the type the collective's result
  would have. Every rank has the same shapes, so every rank skips alike."""
  empty = jnp.zeros(shape, dtype)  # varies over no axis
  return jax.lax.pcast(empty, tuple(sorted(axes, key=str)), to="varying") if axes else empty


def register_batcher(primitive: Primitive, op: str, rule: Callable) -> None:
  """Batches ``primitive`` by ``rule(args, dims, **params)``. A call bound
  under a ``vmap`` whose axis name is the call's axis (the op's fallback
  check saw no vmap there: an inner function traced before the vmap
  batched it) means the vmap axis, which no b12x channel serves: an error,
  never a sum over the mesh axis of that name. Unbatched operands bind the
  primitive as it is."""
  def fancy_rule(axis_data, args, dims, *, axis_name: str, **params):
    if axis_data.name == axis_name:
      raise ValueError(f"b12x_jax.{op}: axis {axis_name!r} names both a jax.vmap axis and the mesh axis of the "
                       f"call; give the vmap axis another name")
    if all(d is None for d in dims):
      outs = primitive.bind(*args, axis_name=axis_name, **params)
      return outs, [None] * len(outs) if primitive.multiple_results else None
    del params["site"]  # the batched call is a call of its own
    return rule(args, dims, axis_name=axis_name, **params)

  batching.fancy_primitive_batchers[primitive] = fancy_rule


def batch_size(args, dims) -> int:
  """The size of the vmapped dimension, from the arguments a batching rule
  gets (at least one is batched)."""
  return next(a.shape[d] for a, d in zip(args, dims) if d is not None)


def _lowering(op: str, target: str, fallback: Callable, fallback_path: str) -> Callable:
  """A lowering rule: prepares the call's channel for the device groups of
  its axis (DESIGN C4: before any execution), then emits the FFI custom call
  with ``channel_id`` and the op's static parameters as attributes and the
  channel's token as its first operand and result. Where the group's
  transport is broken and the policy allows, lowers ``fallback`` (the
  ``fallback_path``: psum, or all_to_all for dcp_a2a) instead, and the token
  passes through unchanged."""
  # No side effect (DESIGN "Call order"): the channel's token already keeps
  # every call, in order; has_side_effect=True only cost 0.9 us per call on
  # CUDA (kept out of command buffers).
  ffi_rule = jax.ffi.ffi_lowering(target, has_side_effect=False)
  fallback_rule = mlir.lower_fun(fallback, multiple_results=True)
  token = _compat.abstract_token()

  def rule(ctx, *args, axis_name: str, channel: str, platform: str, site: int, kernel: str = "ffi", **params):
    try:
      groups = _compat.axis_device_groups(ctx, axis_name)
    except ValueError as e:
      raise ValueError(f"b12x_jax.{op}: {e}") from None
    _native.ensure_registered()
    comm = get_communicator()
    if comm.ensure_prepared(op, channel, groups, fallback_path) is not None:
      return fallback_rule(ctx, *args, axis_name=axis_name, **params)
    effect = channel_order(channel, axis_name)
    token_in = ctx.tokens_in.get(effect)
    triton = None
    if kernel == "triton":
      triton = triton_lowering(ctx, op, channel, groups, platform, site, params)
    if platform == "cuda":
      # XLA:GPU's dynamic-slice fusion folds a slice operand or a
      # dynamic-update-slice result into the custom call, and then fails on
      # the token operand (jax 0.11.2: "Check failed: shape.IsArray() ||
      # shape.IsTuple()" in PriorityFusion's cost analysis). Barriers keep
      # the call's operands and results its own. For a Triton kernel they
      # are the order itself: its operands leave the barrier with the
      # channel's token, its results enter the one the next token leaves.
      token_in, *args = _compat.optimization_barrier([token_in, *args])
    if triton is not None:
      token_out, results = token_in, triton(ctx.replace(tokens_in=mlir.TokenSet()), *args)  # no effects inside
    else:
      avals_in, placement = (token, *ctx.avals_in), []
      if _compat.lowering_for_export(ctx):
        avals_in, placement = (*avals_in, _PLACEMENT_AVAL), [placement_operand(ctx)]
      token_ctx = ctx.replace(avals_in=avals_in, avals_out=(token, *ctx.avals_out))
      token_out, *results = ffi_rule(token_ctx, token_in, *args, *placement, channel_id=channel,
                                     group=partition_key(groups), site=np.int32(site), **params)
    if platform == "cuda":
      token_out, *results = _compat.optimization_barrier([token_out, *results])
    ctx.set_tokens_out(mlir.TokenSet({effect: token_out}))
    return results

  return rule


_PLACEMENT_AVAL = jax.core.ShapedArray((), np.int32)


def placement_operand(ctx):
  """The operand an exported call ends its operands with (docs/DESIGN.md,
  "Placement"): the id of the device this lowering puts at the mesh
  position the call runs at, looked up by that position when it runs. The
  handler compares it with its own device: a module called with its devices
  at other mesh positions than it was exported for stops with an error on
  every rank, instead of exchanging with the peers its ``group`` attribute
  names, which are another axis's there."""
  names, devices = _compat.mesh_devices(ctx)  # every axis manual (why_not_a_mesh_axis)
  ids = np.array([d.id for d in devices.flat], np.int32)

  def expected_device():
    return jnp.asarray(ids)[jax.lax.axis_index(names)]

  (value,) = mlir.lower_fun(lambda: [expected_device()], multiple_results=True)(
      ctx.replace(avals_in=(), avals_out=(_PLACEMENT_AVAL,)))
  return value


def triton_lowering(ctx, op: str, channel: str, groups, platform: str, site: int,
                    params: dict) -> Callable | None:
  """The Triton kernel's lowering of a call bound with kernel "triton"
  (docs/DESIGN.md, "Triton kernels"), or None where it cannot run here: the
  FFI kernel of the same protocol takes the call, and the decision says why
  (an error under policy "strict"). Reads every local device's kernel view
  of the prepared channel, gets the other processes' rows
  (Communicator.exchange_records) and bakes the whole table into the
  program; each device picks its row by its mesh position."""
  from b12x_jax import kernels as triton

  comm = get_communicator()
  names, devices = _compat.mesh_devices(ctx)
  if platform != "cuda":
    return comm.kernel_fallback(op, channel, f"Pallas Triton has no {platform} path")
  if _compat.lowering_for_export(ctx):
    return comm.kernel_fallback(op, channel, "jax.export: an exported module must not carry this process's "
                                "channel addresses, which the Triton kernel bakes in")
  aval = ctx.avals_in[0]
  nbytes = int(np.prod(aval.shape)) * aval.dtype.itemsize
  # Every process bakes every device's row (its own mapping of its peers):
  # the table is a constant of the one program every process lowers
  # (DESIGN "Call order"), so each group spans the mesh's processes.
  processes = {d.process_index for d in devices.flat}
  if any({d.process_index for d in group} != processes for group in groups):
    return comm.kernel_fallback(op, channel, "a device group of the axis leaves out a process of the mesh (each "
                                "process bakes every device's addresses into the program they all lower)")
  partition = partition_key(groups)
  table = np.zeros((devices.size, triton.ROW_WORDS), np.int32)
  kernels, poison = {}, comm.poison_outputs  # plan -> kernel
  position = {d.id: i for i, d in enumerate(devices.flat)}
  for group in groups:
    local = {}
    for device in group:
      if device.process_index != jax.process_index():
        continue
      view = _native.kernel_view(_compat.platform_of(group), channel, partition, _compat.device_ordinal(device),
                                 nbytes, dtype=aval.dtype.name, site=site)
      planned = triton.call_for(op, view, ctx.avals_in, params, channel=channel, site=site, poison=poison)
      if isinstance(planned, str):
        return comm.kernel_fallback(op, channel, planned)
      kernels.setdefault(planned.plan, planned.kernel)
      local[view["rank"]] = triton.table_row(view).tobytes()
    rows = comm.exchange_records(channel, partition, group, "triton_row", local)
    for rank, device in enumerate(group):
      table[position[device.id]] = np.frombuffer(rows[rank], np.int32)
  if len(kernels) != 1:  # every group of the partition has the same options and sizes
    raise ChannelError(f"b12x_jax.{op}: the groups of channel {channel!r} planned different Triton kernels "
                       f"({sorted(map(str, kernels))}); prepare them with one Communicator")
  (kernel,) = kernels.values()

  def call(*args):
    row = jnp.asarray(table)[jax.lax.axis_index(names)] if table.shape[0] > 1 else jnp.asarray(table[0])
    # The row leaves a barrier of its own, as the other operands do (_lowering):
    # XLA:GPU's dynamic-slice fusion may otherwise fold its slice of the table
    # into the custom call, with an offset computed by XLA instead of this one.
    return kernel(jax.lax.optimization_barrier(row), *args)

  return mlir.lower_fun(call, multiple_results=True)


def differentiate_by_fallback(primitive: Primitive, fallback: Callable) -> None:
  """Gives ``primitive`` a JVP: the primal from the primitive, the tangent
  from ``fallback``'s formula (jax collectives, which JAX knows how to
  linearize and transpose), so grad and jvp see the same math as the
  fallback path."""
  def jvp(primals, tangents, *, channel: str, site: int, **params):
    outs = primitive.bind(*primals, channel=channel, site=site, **params)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    _, tangent_outs = jax.jvp(lambda *args: fallback(*args, **params), tuple(primals), tuple(tangents))
    return outs, tangent_outs

  ad.primitive_jvps[primitive] = jvp


def collective_primitive(name: str, op: str, abstract_eval: Callable, fallback: Callable,
                         fallback_path: str = "psum", multiple_results: bool = False) -> Primitive:
  """The primitive of one b12x op, registered: ``abstract_eval`` (the
  output avals, without effects) plus the call's effect (the ChannelOrder
  of its channel and axis: channels.py), an
  eager rule that says where the op runs, the b12x lowering on CPU and CUDA,
  and ``fallback`` (which takes the op's parameters but ``channel``) on every
  other platform (jax.export to ROCm or TPU), recorded as the
  ``fallback_path``, an IneligibleError under policy "strict". The FFI
  target is named like the primitive."""
  primitive = Primitive(name)
  primitive.multiple_results = multiple_results

  def effectful_abstract_eval(*avals, channel: str, site: int, **params):
    del site
    return abstract_eval(*avals, channel=channel, **params), {channel_order(channel, params["axis_name"])}

  def eager(*args, axis_name: str, channel: str, site: int, **params):
    raise ValueError(f"b12x_jax.{op} runs inside jax.shard_map under jax.jit, not eagerly "
                     f"(axis {axis_name!r}, channel {channel!r})")

  fallback_rule = mlir.lower_fun(fallback, multiple_results=True)

  def elsewhere(ctx, *args, channel: str, site: int, **params):
    del site
    platforms = "/".join(ctx.platforms or ctx.module_context.platforms)
    get_communicator().outside_window(op, channel, f"no b12x backend for platform {platforms!r} (CPU and CUDA only)",
                                      "Lower for 'cpu' or 'cuda'", fallback_path)
    return fallback_rule(ctx, *args, **params)

  primitive.def_effectful_abstract_eval(effectful_abstract_eval)
  primitive.def_impl(eager)
  for platform in ("cpu", "cuda"):
    mlir.register_lowering(primitive, functools.partial(_lowering(op, name, fallback, fallback_path),
                                                        platform=platform), platform=platform)
  mlir.register_lowering(primitive, elsewhere)
  return primitive
