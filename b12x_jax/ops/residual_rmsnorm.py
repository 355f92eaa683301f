"""all_reduce_residual_rmsnorm: the decode step's all-reduce, residual add
and RMSNorm in one collective (one kernel on CUDA)."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching

from b12x_jax import _compat, _native
from b12x_jax.channels import resolve_channel
from b12x_jax.communicator import get_communicator
from b12x_jax.policy import PACK_BYTES, Decision
from b12x_jax import kernels
from b12x_jax.ops._common import (as_array, axis_size, batch_size, call_site, channel_blocks, collective_primitive,
                                  differentiate_by_fallback, register_batcher, why_not_a_mesh_axis,
                                  why_not_concrete)
from b12x_jax.ops.all_reduce import all_reduce

_OP = "all_reduce_residual_rmsnorm"
_TARGET = "b12x_residual_rmsnorm"
_DTYPES = ("float32", "bfloat16", "float16")
# -- validation -----------------------------------------------------------------


def _check_operands(x, residual, weight) -> tuple[jax.Array, jax.Array, jax.Array]:
  x, residual, weight = (as_array(_OP, arg, a) for arg, a in (("x", x), ("residual", residual), ("weight", weight)))
  if x.ndim < 1:
    raise ValueError(f"b12x_jax.{_OP}: x must be [..., hidden] (at least 1 dim), got shape {x.shape}")
  if x.dtype.name not in _DTYPES:
    raise TypeError(f"b12x_jax.{_OP}: x must be one of {_DTYPES}, got {x.dtype.name}; cast it")
  if residual.shape != x.shape or residual.dtype != x.dtype:
    raise ValueError(f"b12x_jax.{_OP}: residual must match x ({x.shape} {x.dtype.name}), got "
                     f"{residual.shape} {residual.dtype.name}")
  if weight.shape != x.shape[-1:]:
    raise ValueError(f"b12x_jax.{_OP}: weight must be [hidden] = {x.shape[-1:]}, got {weight.shape}")
  if weight.dtype != x.dtype:
    raise TypeError(f"b12x_jax.{_OP}: weight must have x's dtype {x.dtype.name}, got {weight.dtype.name}; "
                    f"cast it (weight.astype(x.dtype))")
  return x, residual, weight


def _fused_window(rows: int, row_bytes: int, cell: int, max_blocks: int) -> str | None:
  """Why the fused kernel cannot take these rows, or None: it exchanges them
  through the channel's ``max_blocks`` Lamport cells of ``cell`` bytes
  (_native.lamport_cell_bytes: the native layout), whole rows per block."""
  if cell == 0:
    return "the Lamport window is off (lamport_bytes=0)"
  if row_bytes % PACK_BYTES:
    return f"a row of {row_bytes} bytes is not a multiple of 16 bytes"
  rows_per_block = -(-rows // max_blocks)
  if rows_per_block * row_bytes > cell:
    return (f"{rows} rows of {row_bytes} bytes exceed the {max_blocks} Lamport cells of {cell} bytes "
            f"(raise Communicator(lamport_bytes=...))")
  return None


# -- public function -------------------------------------------------------------


def all_reduce_residual_rmsnorm(x, residual, weight, axis_name: str, *, eps: float = 1e-6,
                                channel: str | None = None) -> tuple[jax.Array, jax.Array]:
  """All-reduce, residual add and RMSNorm, as in a transformer decode step
  after a row-parallel layer. Returns ``(normed, new_residual)``:

    new_residual = sum over the ranks of axis_name of x, plus residual
    normed = new_residual * rsqrt(mean(new_residual**2, -1) + eps) * weight

  ``x`` [..., hidden] is this rank's partial sum, ``residual`` the same
  shape and dtype (the same on every rank), ``weight`` [hidden];
  float32/bfloat16/float16, one dtype. fp32 math: the sum over ranks in
  rank order plus residual is rounded once to ``new_residual``, and the
  norm is computed from that rounded value (what the next layer adds to);
  every rank gets the same bits. Call it inside ``jax.shard_map`` under
  ``jax.jit``; the results are invariant over the axis.

  Fused (one kernel on CUDA, the Lamport exchange of all_reduce) when the
  rows fit the channel's Lamport window (``Communicator(lamport_bytes=...)``,
  whole rows per block, at most 64 blocks or the GPU's SM count); otherwise
  the same math from
  ``all_reduce`` of x in float32 followed by the add (rounded once, so the
  new residual has the fused op's bits where the sum runs on b12x) and the
  norm in jnp (its sum of squares in jnp's order), with the reason in
  ``get_communicator().decisions``. Under ``jax.vmap`` the batches are
  more leading rows: one call, fused or not by the rows of all batches
  (unfused where the weight is batched: a call takes one weight). Under
  ``Communicator(kernels="triton" | "auto")`` the fused call of float32 or
  bfloat16 rows is a Pallas Triton kernel on CUDA where each row is a power
  of two of at most 8192 32-bit words within one Lamport cell and the rows
  fit the channel's blocks, a row over one block or, where it is large,
  several (``kernels.row_split``; docs/DESIGN.md "Triton kernels"); other fused calls take the FFI kernel, recorded in decisions. Over a
  ``vmap`` axis name it is unfused, on psum (policy "auto"), or an
  IneligibleError (policy "strict").
  """
  x, residual, weight = _check_operands(x, residual, weight)
  eps = _static_eps(eps)
  size = axis_size(axis_name, _OP)
  name = resolve_channel(channel, _OP)
  comm = get_communicator()
  exchanges = size > 1 or comm.loopback  # loopback: a group of one runs the exchange too
  not_concrete = why_not_concrete("x", x)
  if not_concrete is not None or x.size == 0:  # no rows to plan: the unfused math, as psum and jnp give it
    if exchanges and not_concrete is not None:
      comm.outside_window(_OP, name, *not_concrete, fallback="unfused")
    return _unfused(lambda t: all_reduce(t, axis_name, channel=channel), x, residual, weight, eps)
  row_bytes = x.shape[-1] * x.dtype.itemsize
  rows = x.size // x.shape[-1]
  grid = channel_blocks(comm.max_blocks)
  cell = _native.lamport_cell_bytes(comm.native_options(), grid)
  not_a_mesh_axis = why_not_a_mesh_axis(axis_name)
  why_not = _fused_window(rows, row_bytes, cell, grid)
  if exchanges and not_a_mesh_axis is not None:
    comm.outside_window(_OP, name, *not_a_mesh_axis, fallback="unfused")
  elif exchanges and why_not is None:
    kernel = comm.choose_kernel(_OP, kernels.why_not(x.dtype, x.size * x.dtype.itemsize, None) or
                                kernels.rows_problem(rows, row_bytes, cell, grid))
    decision = comm.choose_path(_OP, name, x.size * x.dtype.itemsize, x.dtype, size, kernel=kernel)
    if decision.path == "b12x":
      normed, new_residual = residual_rmsnorm_p.bind(x, residual, weight, axis_name=axis_name, channel=name,
                                                     eps=np.float32(eps),  # the handler's f32 attribute
                                                     kernel=decision.kernel, site=call_site(_OP))
      return normed, new_residual
  elif exchanges:
    comm.record(Decision(_OP, name, "unfused", why_not))
  return _unfused(lambda t: all_reduce(t, axis_name, channel=channel), x, residual, weight, eps)


def _static_eps(eps) -> float:
  """``eps`` as the float the call bakes in (a static attribute), or a
  clear error: a traced value, a non-number, or one not finite and > 0."""
  if isinstance(eps, jax.core.Tracer):
    raise TypeError(f"b12x_jax.{_OP}: eps must be a constant (a static attribute of the call), got a traced "
                    f"value {eps!r}; pass a Python float")
  real = isinstance(eps, numbers.Real) or (  # NumPy, ml_dtypes and JAX scalars too
      isinstance(eps, (np.ndarray, np.generic, jax.Array)) and np.shape(eps) == ()
      and (jnp.issubdtype(eps.dtype, jnp.floating) or jnp.issubdtype(eps.dtype, jnp.integer)))
  if not real or isinstance(eps, (bool, np.bool_)):
    raise TypeError(f"b12x_jax.{_OP}: eps must be a real number, got {eps!r}; pass a Python float such as 1e-6")
  value = float(eps)
  with np.errstate(over="ignore", under="ignore"):
    single = np.float32(value)  # what the math adds: float32
  tiny, largest = np.finfo(np.float32).tiny, np.finfo(np.float32).max
  if not (tiny <= single <= largest):  # a subnormal: XLA flushes it to 0, and a zero row is NaN
    raise ValueError(f"b12x_jax.{_OP}: eps must be a normal float32 > 0 (the norm's math), got {eps!r} "
                     f"(float32: {single}); pass one in [{tiny:.3g}, {largest:.3g}]")
  return value


def _unfused(reduce, x, residual, weight, eps: float) -> tuple[jax.Array, jax.Array]:
  """The fused op's math after a separate sum over the ranks (``reduce``:
  all_reduce or psum) of ``x`` in float32: plus the residual, rounded once
  to x's dtype, as the fused kernel rounds (a sum in x's dtype would round
  twice, and a 16-bit new residual would differ from the fused op's by the
  path a call took); then the norm of the rounded value."""
  new_residual = (reduce(x.astype(jnp.float32)) + residual.astype(jnp.float32)).astype(x.dtype)
  r = new_residual.astype(jnp.float32)
  scale = jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + eps)
  return (r * scale * weight.astype(jnp.float32)).astype(x.dtype), new_residual


# -- lowering ---------------------------------------------------------------------


def _abstract_eval(x, residual, weight, *, axis_name: str, channel: str, eps: float, kernel: str):
  # The types of _unfused's: the sum is invariant over the axis, the residual
  # adds its varying axes, the weight those of its own to the normed output.
  del channel, eps, kernel
  new_residual = _compat.add_varying_axes(_compat.drop_varying_axis(x, axis_name), _compat.varying_axes(residual))
  return [_compat.add_varying_axes(new_residual, _compat.varying_axes(weight)), new_residual]


def _psum_path(x, residual, weight, *, axis_name: str, eps: float, kernel: str = "ffi"):
  del kernel
  return list(_unfused(lambda t: jax.lax.psum(t, axis_name), x, residual, weight, eps))


# -- batching --------------------------------------------------------------------


def _batch(args, dims, *, axis_name: str, channel: str, eps: float, kernel: str):
  """A batched call is one call with the batches as more leading rows of x
  and residual, fused or not (and its kernel) by the size of all of them. A batched weight
  (one per batch) cannot be one fused call: then the batches' x are summed
  in one all_reduce and each is normed with its own weight."""
  del kernel
  vmapped = batch_size(args, dims)
  x, residual = (batching.bdim_at_front(a, d, vmapped) for a, d in zip(args[:2], dims[:2]))
  weight, weight_dim = args[2], dims[2]
  if weight_dim is None:
    results = all_reduce_residual_rmsnorm(x, residual, weight, axis_name, eps=float(eps), channel=channel)
  else:
    get_communicator().record(Decision(_OP, channel, "unfused",
                                       "the weight is batched (vmap): one fused call takes one weight"))
    weights = batching.bdim_at_front(weight, weight_dim, vmapped)
    per_batch = weights.reshape((vmapped,) + (1,) * (x.ndim - 2) + weights.shape[-1:])
    results = _unfused(lambda t: all_reduce(t, axis_name, channel=channel), x, residual, per_batch, eps)
  return list(results), [0, 0]


# -- registration ----------------------------------------------------------------

residual_rmsnorm_p = collective_primitive(_TARGET, _OP, _abstract_eval, _psum_path, multiple_results=True)
differentiate_by_fallback(residual_rmsnorm_p, _psum_path)
register_batcher(residual_rmsnorm_p, _OP, _batch)
