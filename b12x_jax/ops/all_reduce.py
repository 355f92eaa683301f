"""all_reduce: sum over a mesh axis, one-shot or two-shot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from b12x_jax import _compat, _native, tuning
from b12x_jax.channels import resolve_channel, validate_channel_name
from b12x_jax.communicator import get_communicator
from b12x_jax.policy import PACK_BYTES
from b12x_jax import kernels
from b12x_jax.ops._common import (as_array, axis_size, call_site, collective_primitive, empty_result, register_batcher,
                                  why_not_a_mesh_axis, why_not_concrete)

_OP = "all_reduce"
_TARGET = "b12x_all_reduce"
# The `algorithm` attribute of the custom call (ffi/cuda/all_reduce.cu).
_ALGORITHM_CODES = {name: _native.ALGORITHMS[name] for name in ("one_shot", "two_shot", "one_shot_pull")}
# Leaves of a pytree that may share one call (the dtypes of the b12x path).
_PACKED_DTYPES = ("float32", "bfloat16", "float16")

# -- validation -----------------------------------------------------------------


def _check_operand(x) -> jax.Array:
  """A leaf of x as an array: arrays and Python or NumPy numbers, as psum takes."""
  if isinstance(x, (bool, int, float, complex, np.number)):
    return jnp.asarray(x)
  return as_array(_OP, "x", x, "an array (or a pytree of arrays)")


# -- public function -------------------------------------------------------------


def all_reduce(x, axis_name, *, axis_index_groups=None, channel: str | None = None):
  """Sum of ``x`` over the devices of mesh axis ``axis_name``, like
  ``jax.lax.psum(x, axis_name)``: a drop-in for it, under jax.grad, jvp,
  vmap and checkpoint too.

  Call it inside ``jax.shard_map`` (under ``jax.jit``). Every rank gets the
  same bits: fp32 accumulation in rank order 0..N-1, one rounding to x's
  dtype. Runs on the channel of the enclosing ``b12x_jax.channel`` scope
  (or ``channel``; "default" outside any scope).

  ``x`` may be a pytree: leaves of one dtype (and one set of varying axes)
  whose total fits the Lamport window (``lamport_bytes``) are packed into
  one call, padded to a multiple of 16 bytes (so a leaf that is not one
  runs on b12x too); each leaf gets the bits a b12x call of its own would
  give. The other leaves are a call each. Leaves no device traces
  (numbers, NumPy arrays) are summed while tracing, leaf by leaf as psum
  sums them, into static values: ``all_reduce(1, axis)`` is the axis size,
  an int.
  ``axis_name`` a name or a tuple of names, and ``axis_index_groups`` what
  psum takes. The b12x path takes
  one shard_map mesh axis without groups (or with one group of the whole
  axis), float32/bfloat16/float16 payloads that are a multiple of 16 bytes
  and at most the communicator's ``capacity_bytes``; anything else (a tuple
  of several axes, groups that split the axis, a
  ``vmap`` axis name) is psum under policy "auto" or an IneligibleError
  under "strict". Under "auto", psum also where the measured crossovers say
  it is faster. Above the Lamport window the kernel is one-shot or two-shot
  by the communicator's ``algorithm`` (b12x_jax.tuning when "auto"). Inside
  it, ``Communicator(kernels=...)`` picks the FFI kernel or the Pallas Triton
  kernel of the same protocol (float32 and bfloat16 on CUDA; docs/DESIGN.md "Triton
  kernels"). The choice and the reason are recorded in
  ``get_communicator().decisions``.

  Differentiation follows psum: the tangent is an all_reduce on the same
  channel; the cotangent is the cotangent itself where shard_map tracks
  varying axes (check_vma, the default), else its all_reduce.
  """
  leaves, tree = jax.tree.flatten(x)
  if not leaves:
    return x  # an empty pytree, as psum returns it
  axes = _axes(axis_name)
  for axis in axes:
    axis_size(axis, _OP)
  if len(set(axes)) != len(axes):  # XLA aborts the process on such a sum
    raise ValueError(f"b12x_jax.{_OP}: axis_name {axis_name!r} names an axis twice; name each axis once")
  if channel is not None:  # constants take no channel, but a bad name is an error wherever it is passed
    validate_channel_name(channel, f"b12x_jax.{_OP}(channel=...)")
  checked = [_check_operand(leaf) for leaf in leaves]
  results: list = [None] * len(leaves)
  traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.core.Tracer)]
  constants = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, jax.core.Tracer)]
  if constants:
    # Values every device holds alike (psum(1, axis), the axis size): psum
    # sums them while tracing, with no collective, into static values.
    for i in constants:
      results[i] = jax.lax.psum(leaves[i], axis_name, axis_index_groups=axis_index_groups)
  operands = [checked[i] for i in traced]
  for pack in _packs(operands, axis_name, axis_index_groups):
    if len(pack) == 1:
      results[traced[pack[0]]] = _all_reduce_leaf(operands[pack[0]], axis_name, axis_index_groups, channel)
    else:
      for i, result in zip(pack, _all_reduce_packed([operands[i] for i in pack], axis_name, channel)):
        results[traced[i]] = result
  # Weak types as psum's (a pack is strong, a call keeps its operand's):
  # downstream dtype promotion must not differ from psum's. Only a weak
  # operand can have a weak sum, so the common case traces no psum.
  if any(jax.typeof(operand).weak_type for operand in operands):
    like_psum = jax.eval_shape(lambda t: jax.lax.psum(t, axis_name, axis_index_groups=axis_index_groups), operands)
    for i, aval in zip(traced, like_psum):
      results[i] = _compat.with_weak_type(results[i], aval.weak_type)
  return tree.unflatten(results)


def _axes(axis_name) -> tuple:
  """``axis_name`` as psum reads it: a name, or a tuple or list of names."""
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _packs(leaves: list[jax.Array], axis_name, axis_index_groups) -> list[list[int]]:
  """The leaves (indices, in order) that are reduced together: small
  leaves of one dtype and one type (varying axes) whose padded total fits
  the Lamport window and capacity_bytes share one call, the rest are a call each. Only where
  b12x can run the sum at all (one mesh axis, no groups, a supported
  dtype)."""
  comm = get_communicator()
  axes = _axes(axis_name)
  if len(leaves) == 1 or comm.policy == "psum" or _why_psum_only(axes, axis_index_groups) is not None:
    return [[i] for i in range(len(leaves))]
  window = comm.lamport_window  # a pack is one call in the Lamport window
  open_packs: dict[tuple, tuple[list[int], int]] = {}  # (dtype, varying axes) -> (indices, bytes)
  packs: list[list[int]] = []
  for i, leaf in enumerate(leaves):
    if why_not_concrete("x", leaf) is not None:
      packs.append([i])
      continue
    nbytes = leaf.size * leaf.dtype.itemsize
    if leaf.dtype.name not in _PACKED_DTYPES or nbytes == 0 or _padded(nbytes) > window:
      packs.append([i])
      continue
    key = (leaf.dtype, _compat.varying_axes(jax.typeof(leaf)))
    indices, total = open_packs.get(key, (None, 0))
    if indices is None or _padded(total + nbytes) > window:
      indices, total = [], 0
      packs.append(indices)
    indices.append(i)
    open_packs[key] = (indices, total + nbytes)
  return packs


def _padded(nbytes: int) -> int:
  return -(-nbytes // PACK_BYTES) * PACK_BYTES


def _all_reduce_packed(leaves: list[jax.Array], axis_name, channel: str | None) -> list[jax.Array]:
  """One call for ``leaves`` (one dtype): raveled, concatenated and padded
  with zeros to a multiple of 16 bytes, reduced, split back. The sum is
  elementwise in rank order, so each leaf gets the bits a call of its own
  would give it."""
  flat = jnp.concatenate([leaf.ravel() for leaf in leaves])
  pad = _padded(flat.size * flat.dtype.itemsize) // flat.dtype.itemsize - flat.size
  packed = jnp.pad(flat, (0, pad))
  detail = f"{len(leaves)} leaves packed into one call of {packed.size * packed.dtype.itemsize} bytes"
  total = _all_reduce_leaf(packed, axis_name, None, channel, detail=detail)
  offsets = np.cumsum([0] + [leaf.size for leaf in leaves])
  return [total[start:stop].reshape(leaf.shape) for leaf, start, stop in zip(leaves, offsets[:-1], offsets[1:])]


def _all_reduce_leaf(x: jax.Array, axis_name, axis_index_groups, channel: str | None,
                     detail: str = "") -> jax.Array:
  axes = _axes(axis_name)
  name = resolve_channel(channel, _OP)
  sizes = [axis_size(a, _OP) for a in axes]
  psum = lambda: jax.lax.psum(x, axis_name, axis_index_groups=axis_index_groups)  # noqa: E731
  comm = get_communicator()
  symbolic = why_not_concrete("x", x)
  if symbolic is None and x.size == 0:
    return _empty_sum(x, axes, jax.eval_shape(psum))
  if all(s == 1 for s in sizes) and not comm.loopback:
    return psum()  # nothing crosses a link; psum's type (invariant over the axis)
  why_not = _why_psum_only(axes, axis_index_groups) or symbolic
  if why_not is not None:
    comm.outside_window(_OP, name, *why_not)
    return psum()
  (axis,), (size,) = axes, sizes
  nbytes = x.size * x.dtype.itemsize
  algorithm, why, psum_is_faster = _algorithm(comm, nbytes, size)
  kernel = comm.choose_kernel(_OP, kernels.why_not(x.dtype, nbytes, comm.lamport_window))
  decision = comm.choose_path(_OP, name, nbytes, x.dtype, size, detail=f"{detail}; {why}" if detail else why,
                              prefer_fallback=psum_is_faster, kernel=kernel)
  if decision.path == "psum":
    return psum()
  return all_reduce_p.bind(x, axis_name=axis, channel=name, algorithm=np.int32(_ALGORITHM_CODES[algorithm]),
                           kernel=decision.kernel, site=call_site(_OP))


def _empty_sum(x: jax.Array, axes: tuple, like: jax.ShapeDtypeStruct) -> jax.Array:
  """The sum of an empty ``x`` over ``axes``: an empty array of psum's type
  with no collective (empty_result). ``like`` is psum's result traced apart
  (eval_shape: its dtype, int32 for bool, and its errors); the varying
  axes, which it does not keep, are x's other axes."""
  return empty_result(x.shape, like.dtype, _compat.varying_axes(jax.typeof(x)) - set(axes))


def _why_psum_only(axes: tuple, axis_index_groups) -> tuple[str, str] | None:
  """(reason, fix) where only psum can run the sum, else None: a channel is
  one group of devices along one shard_map mesh axis (axis_index_groups of
  one group of the whole axis is that group)."""
  if len(axes) != 1:
    return f"it sums over several axes {axes}", "Sum over one mesh axis per call"
  why_not = why_not_a_mesh_axis(axes[0])
  if why_not is None and axis_index_groups is not None and not _the_whole_axis(axis_index_groups, axes[0]):
    return "axis_index_groups splits the axis into groups", "Sum over a mesh axis of the group's size instead"
  return why_not


def _the_whole_axis(axis_index_groups, axis) -> bool:
  """Whether ``axis_index_groups`` is one group of every index of ``axis``
  (groups psum would reject are not: psum then says why)."""
  try:
    groups = [sorted(int(i) for i in group) for group in axis_index_groups]
  except (TypeError, ValueError):
    return False
  return groups == [list(range(jax.lax.axis_size(axis)))]


def _algorithm(comm, nbytes: int, size: int) -> tuple[str, str, str | None]:
  """The kernel for ``nbytes`` over ``size`` ranks above the Lamport window
  ("one_shot", "two_shot" or "one_shot_pull"), why, and why psum would be
  faster (or None): the Communicator's setting, else the crossovers of
  tuning.py. Within the window the reason says Lamport, whatever the
  setting. With several processes only the packaged table is used: every
  process must choose alike, and a per-user stored calibration may differ
  between them."""
  if nbytes <= comm.lamport_window:  # whatever the setting: every handler plans Lamport here (ffi/all_reduce.h plan_for)
    return "one_shot", "within the Lamport window (the Lamport exchange)", None
  if comm.algorithm != "auto":
    return comm.algorithm, f"{comm.algorithm} (Communicator(algorithm={comm.algorithm!r}))", None
  crossover = tuning.crossover_for(jax.devices()[0].device_kind, size, stored=jax.process_count() == 1)
  if crossover.two_shot_from is not None and nbytes >= crossover.two_shot_from:
    algorithm, why = "two_shot", f"two_shot from {crossover.two_shot_from} bytes ({crossover.source})"
  else:
    algorithm, why = "one_shot", f"one_shot ({crossover.source})"
  faster = crossover.psum_from is not None and nbytes >= crossover.psum_from
  return algorithm, why, f"psum is faster from {crossover.psum_from} bytes ({crossover.source})" if faster else None


# -- lowering ---------------------------------------------------------------------


def _abstract_eval(x, *, axis_name: str, channel: str, algorithm: int, kernel: str):
  del channel, algorithm, kernel
  return _compat.drop_varying_axis(x, axis_name)


def _psum_path(x, *, axis_name: str, algorithm: int = 0, kernel: str = "ffi"):
  del algorithm, kernel
  return [jax.lax.psum(x, axis_name)]


# -- differentiation and batching ---------------------------------------------


def _transpose(ct, x, *, axis_name: str, channel: str, algorithm: int, kernel: str, site: int):
  """psum's rule (jax.lax.psum): where types track varying axes the sum's
  cotangent reaches each rank as is, else it is summed again, on the same
  channel."""
  del algorithm, kernel, site
  if type(ct) is ad.Zero:
    return (ad.Zero(x.aval),)
  if axis_name in _compat.varying_axes(x.aval):
    return (jax.lax.pcast(ct, axis_name, to="varying"),)
  return (all_reduce(ct, axis_name, channel=channel),)


def _batch(args, dims, *, axis_name: str, channel: str, algorithm: int, kernel: str):
  """A batched all_reduce is one all_reduce of the stacked payload, its path
  (and kernel) chosen again for that size."""
  del algorithm, kernel
  (x,), (dim,) = args, dims
  return all_reduce(x, axis_name, channel=channel), dim


# -- registration ----------------------------------------------------------------

all_reduce_p = collective_primitive(_TARGET, _OP, _abstract_eval, _psum_path)
ad.deflinear2(all_reduce_p, _transpose)
register_batcher(all_reduce_p, _OP, _batch)
