"""dcp_a2a: the DCP merge of partial attention over a mesh axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching

from b12x_jax import _compat, _native
from b12x_jax.channels import resolve_channel
from b12x_jax.communicator import get_communicator
from b12x_jax.policy import PACK_BYTES
from b12x_jax import kernels
from b12x_jax.ops._common import (MAX_BLOCKS, as_array, axis_size, batch_size, call_site, channel_blocks, collective_primitive,
                                  differentiate_by_fallback, empty_result, register_batcher, why_not_a_mesh_axis,
                                  why_not_concrete)

_OP = "dcp_a2a"
_TARGET = "b12x_dcp_a2a"
_FALLBACK = "all_to_all"
_OUT_DTYPES = ("bfloat16", "float16")
_LSE_BASES = ("e", "2")
_LSE_BYTES = 4

# -- validation -----------------------------------------------------------------


def _check_operands(out, lse, lse_base: str, return_lse) -> tuple[jax.Array, jax.Array]:
  out, lse = as_array(_OP, "out", out), as_array(_OP, "lse", lse)
  if out.ndim != 3:
    raise ValueError(f"b12x_jax.{_OP}: out must be [B, H, D] (3 dims), got shape {out.shape}; "
                     f"reshape the partial attention output to batch x heads x head_dim")
  if out.shape[2] == 0:  # XLA's partitioner crashes the process on such an all_to_all, the fallback's
    raise ValueError(f"b12x_jax.{_OP}: out must have a head_dim D of at least 1, got shape {out.shape}")
  if out.dtype.name not in _OUT_DTYPES:
    raise TypeError(f"b12x_jax.{_OP}: out must be bfloat16 or float16, got {out.dtype.name}; "
                    f"cast it (out.astype(jnp.bfloat16))")
  if lse.shape != out.shape[:2]:
    raise ValueError(f"b12x_jax.{_OP}: lse must have shape out.shape[:2] = {out.shape[:2]} ([B, H]), "
                     f"got {lse.shape}")
  if lse.dtype != jnp.float32:
    raise TypeError(f"b12x_jax.{_OP}: lse must be float32, got {lse.dtype.name}; cast it (lse.astype(jnp.float32))")
  if not isinstance(return_lse, (bool, np.bool_)):
    raise TypeError(f"b12x_jax.{_OP}: return_lse must be a bool, got {return_lse!r}")
  if lse_base not in _LSE_BASES:
    raise ValueError(f"b12x_jax.{_OP}: lse_base must be 'e' (natural log) or '2' (log2), got {lse_base!r}")
  return out, lse


def _check_heads(heads: int, size: int, axis_name: str) -> None:
  if heads % size:
    raise ValueError(f"b12x_jax.{_OP}: H={heads} heads must be a multiple of the {size} devices of axis "
                     f"{axis_name!r}; pad the heads to a multiple of {size}")


def _why_not_tagged(heads: int, row_bytes: int) -> tuple[str, str] | None:
  """(reason, fix) where out [B, H, D] is beyond what a call tag carries
  (a b12x call's peers must tell its shape from others'), else None."""
  max_heads, max_row_bytes = _native.dcp_tag_limits()
  if heads <= max_heads and row_bytes <= max_row_bytes:
    return None
  return (f"out has H={heads} heads of rows of {row_bytes} bytes; a b12x call tag carries at most {max_heads} "
          f"heads of {max_row_bytes} bytes", "split H or D of out over calls")


def _staged_bytes(rows: int, row_bytes: int, max_blocks: int) -> int:
  """Bytes one call stages per source, counted so that it fits whatever
  grid the channel has: a CUDA block stages whole rows in its own cell of
  capacity / max_blocks bytes (ffi/dcp.h, plan_dcp), which wastes less than
  one row plus 16 bytes of rounding per block."""
  per_row = row_bytes + _LSE_BYTES
  return rows * per_row + max_blocks * (per_row + PACK_BYTES)


# -- public function -------------------------------------------------------------


def dcp_a2a(out, lse, axis_name: str, *, return_lse: bool = False, lse_base: str = "e",
            channel: str | None = None):
  """The DCP merge: combines the partial attention of every rank of mesh
  axis ``axis_name`` and returns this rank's head shard.

  Rank r holds ``out`` [B, H, D] (bfloat16/float16) and ``lse`` [B, H]
  (float32) over its own KV shard, for all H heads; H must be a multiple of
  the axis size N. Rank r gets heads [r*H/N, (r+1)*H/N): with
  ``m = max_s lse_s`` and ``w_s = exp(lse_s - m)`` (``exp2`` when
  ``lse_base="2"``), ``sum_s w_s * out_s / sum_s w_s`` as [B, H/N, D] in
  out's dtype, and with ``return_lse`` also ``m + log(sum_s w_s)`` (log2)
  as [B, H/N] float32: a tuple ``(out, lse)``. A source whose lse is not
  finite (-inf for an empty KV shard or a padded row, NaN, +inf) has weight
  0 and its out is never read; where no source contributes the result is 0
  and its lse -inf. fp32 math, sources summed in rank order 0..N-1.

  Call it inside ``jax.shard_map`` (under ``jax.jit``); the result varies
  over the axis. Runs on the channel of the enclosing ``b12x_jax.channel``
  scope (or ``channel``; "default" outside any scope), in the same ordered
  sequence as the channel's all_reduce calls.

  Takes the b12x path when a row of out is a multiple of 16 bytes and the
  rows fit the channel's Lamport cells (the flagless Lamport exchange, at
  decode sizes: ffi/dcp.h plan_dcp_lamport) or the rows staged per source
  fit the communicator's ``capacity_bytes`` (the barrier protocol);
  otherwise ``jax.lax.all_to_all`` plus the same merge in jnp (policy
  "auto") or an IneligibleError (policy "strict"). The choice is recorded
  in ``get_communicator().decisions``. An empty ``out`` (B or H of 0) over
  a mesh axis gives empty results of the same type with no collective and
  no decision (so no IneligibleError either), as ``all_reduce`` of an empty
  array does. Under ``jax.vmap`` the batches are
  folded into B: one call, its path chosen for the folded size. Over a
  ``vmap`` axis name the fallback runs (policy "auto") or an
  IneligibleError says why (policy "strict").
  """
  out, lse = _check_operands(out, lse, lse_base, return_lse)
  return_lse = bool(return_lse)
  size = axis_size(axis_name, _OP)
  batch, heads, dim = out.shape
  _check_heads(heads, size, axis_name)
  name = resolve_channel(channel, _OP)
  base2 = lse_base == "2"
  comm = get_communicator()
  row_bytes = dim * out.dtype.itemsize
  symbolic, not_mesh = why_not_concrete("out", out), why_not_a_mesh_axis(axis_name)
  why_not = not_mesh or symbolic or _why_not_tagged(heads, row_bytes)
  if size == 1 and not comm.loopback:  # loopback: a group of one runs the exchange too
    results = _merge(out[None], lse[None], base2=base2, return_lse=return_lse)
  elif symbolic is None and not_mesh is None and out.size == 0:
    results = _empty_merge(out, lse, axis_name, heads // size, return_lse)
  elif why_not is not None:
    comm.outside_window(_OP, name, *why_not, fallback=_FALLBACK)
    results = _all_to_all_path(out, lse, axis_name=axis_name, base2=base2, return_lse=return_lse)
  else:
    blocks = channel_blocks(comm.max_blocks)
    cell = _native.lamport_cell_bytes(comm.native_options(), blocks)
    site = call_site(_OP)
    grid, per_block, _ = _native.dcp_lamport_plan(cell, blocks, batch, heads, size, row_bytes,
                                                  dtype=out.dtype.name, site=site, base2=base2)
    lamport = grid > 0  # (0 also for rows not of whole packs, or more ranks than a channel has)
    # In the Lamport window nothing is staged in the barrier protocol's cells.
    # Counted for the largest grid, so the decision is the same on every machine.
    staged = 0 if lamport else _staged_bytes(batch * heads // size, row_bytes, comm.max_blocks or MAX_BLOCKS)
    kernel = comm.choose_kernel(_OP, kernels.dcp_problem(out.dtype, heads, size, row_bytes, grid, per_block)
                                if lamport else "the call is outside the Lamport window")
    protocol = ("lamport (the rows fit the channel's Lamport cells)" if lamport else
                "the barrier protocol (the rows exceed the channel's Lamport cells)")
    decision = comm.choose_path(_OP, name, row_bytes, out.dtype, size, unit="row of out", arg="out",
                                staged_bytes=staged, shrink="split the batch B of out into smaller calls",
                                fallback=_FALLBACK, detail=protocol, kernel=kernel)
    if decision.path == "b12x":
      results = dcp_a2a_p.bind(out, lse, axis_name=axis_name, channel=name, base2=base2, return_lse=return_lse,
                               kernel=decision.kernel, site=site)
    else:
      results = _all_to_all_path(out, lse, axis_name=axis_name, base2=base2, return_lse=return_lse)
  return tuple(results) if return_lse else results[0]


# -- lowering ---------------------------------------------------------------------


def _abstract_eval(out, lse, *, axis_name: str, channel: str, base2: bool, return_lse: bool, kernel: str):
  del channel, base2, kernel
  batch, heads, dim = out.shape
  shard_heads = heads // jax.lax.axis_size(axis_name)
  axes = {axis_name} | _compat.varying_axes(lse)
  merged = _compat.add_varying_axes(out.update(shape=(batch, shard_heads, dim)), axes)
  if not return_lse:
    return [merged]
  return [merged, _compat.add_varying_axes(lse.update(shape=(batch, shard_heads)), axes)]


def _empty_merge(out, lse, axis_name: str, shard_heads: int, return_lse: bool) -> list:
  """The merge of an empty ``out`` (B or H of 0) into ``shard_heads`` heads
  a rank: empty results of the merge's type with no collective
  (empty_result: an empty all_to_all, or an empty call of ours)."""
  batch, _, dim = out.shape
  lse_axes = _compat.varying_axes(jax.typeof(lse)) | {axis_name}  # as _abstract_eval gives them
  merged = empty_result((batch, shard_heads, dim), out.dtype, _compat.varying_axes(jax.typeof(out)) | lse_axes)
  return [merged, empty_result((batch, shard_heads), lse.dtype, lse_axes)] if return_lse else [merged]


def _merge(outs, lses, *, base2: bool, return_lse: bool) -> list:
  """The merge of ffi/dcp.h in jnp: ``outs`` [N, B, h, D] and ``lses``
  [N, B, h] of N sources, summed in source order."""
  finite = jnp.isfinite(lses)
  m = jnp.max(jnp.where(finite, lses, -jnp.inf), axis=0)
  anchor = jnp.where(jnp.isfinite(m), m, 0.0)  # keeps -inf - -inf (NaN) out of the untaken branch
  exp, log = (jnp.exp2, jnp.log2) if base2 else (jnp.exp, jnp.log)
  weights = jnp.where(finite, exp(jnp.where(finite, lses, anchor) - anchor), 0.0)
  total = weights[0]
  for q in range(1, lses.shape[0]):
    total = total + weights[q]
  scale = jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), 0.0)
  acc = jnp.zeros(outs.shape[1:], jnp.float32)
  for q in range(outs.shape[0]):  # rank order (C9); a source of weight 0 is never read
    contributes = (scale[q] != 0)[..., None]
    acc = acc + jnp.where(contributes, scale[q][..., None] * outs[q].astype(jnp.float32), 0.0)
  results = [acc.astype(outs.dtype)]
  if return_lse:
    results.append(jnp.where(total > 0, m + log(jnp.where(total > 0, total, 1.0)), -jnp.inf))
  return results


def _all_to_all_path(out, lse, *, axis_name: str, base2: bool, return_lse: bool, kernel: str = "ffi") -> list:
  """The fallback: every rank sends destination p the heads of p's shard
  with ``jax.lax.all_to_all``, then merges the N sources locally."""
  del kernel
  size = jax.lax.axis_size(axis_name)
  batch, heads, dim = out.shape
  shard_heads = heads // size
  by_dest = out.reshape(batch, size, shard_heads, dim).transpose(1, 0, 2, 3)  # [N, B, h, D]
  lse_by_dest = lse.reshape(batch, size, shard_heads).transpose(1, 0, 2)
  outs = jax.lax.all_to_all(by_dest, axis_name, 0, 0)  # now [source, B, h, D]
  lses = jax.lax.all_to_all(lse_by_dest, axis_name, 0, 0)
  return _merge(outs, lses, base2=base2, return_lse=return_lse)


# -- batching --------------------------------------------------------------------


def _batch(args, dims, *, axis_name: str, channel: str, base2: bool, return_lse: bool, kernel: str):
  """A batched dcp_a2a is one dcp_a2a of the batches folded into B: the
  merge is independent per (row of B, head), so V batches of [B, H, D] are
  one call of [V*B, H, D], its path chosen again for that size."""
  del kernel  # chosen again for the folded size
  out, lse = (batching.bdim_at_front(a, d, batch_size(args, dims)) for a, d in zip(args, dims))
  vmapped, batch, heads, dim = out.shape
  results = dcp_a2a(out.reshape(vmapped * batch, heads, dim), lse.reshape(vmapped * batch, heads), axis_name,
                    return_lse=return_lse, lse_base="2" if base2 else "e", channel=channel)
  results = results if return_lse else (results,)
  return [r.reshape(vmapped, batch, *r.shape[1:]) for r in results], [0] * len(results)


# -- registration ----------------------------------------------------------------

dcp_a2a_p = collective_primitive(_TARGET, _OP, _abstract_eval, _all_to_all_path, _FALLBACK,
                                 multiple_results=True)
differentiate_by_fallback(dcp_a2a_p, _all_to_all_path)
register_batcher(dcp_a2a_p, _OP, _batch)
