"""The fused all_reduce + residual + RMSNorm as a Pallas Triton kernel:
the rows' Lamport exchange with the residual added in the same sum, then
RMSNorm of each row, a row over one program or, where it is large, over
several that meet (row_split; docs/DESIGN.md, "Triton kernels")."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from b12x_jax import _compat, _native
from b12x_jax.kernels.exchange import (MAX_TILE_WORDS, NAN_WORDS, Plan, as_words, failed_outputs, lamport_exchange,
                                       launch, signed_word, sum_in_rank_order, table_spec, to_elements, to_words,
                                       warps_for, wide_warps, with_own)
# The fused op's rows over several programs (row_split): a row of at least
# SPLIT_ROW_WORDS words splits, each program keeps at least MIN_SPLIT_WORDS
# of it, a row takes at most MAX_SPLIT programs. Loopback, bf16, measured
# with the release/acquire meeting before the tagged slots (benchmarks/
# RESULTS.md, 2026-12-06, one H100): 4096-word rows over 4 programs 0.4-0.6 us faster than over 2 and
# 0.7-1.0 faster than over one; 2048-word rows over 2 0.7-0.9 us slower than
# over one (the meeting costs more than it saves); over 8 programs of 512
# words, no gain beyond a noisy machine's spread.
SPLIT_ROW_WORDS = 4096
MIN_SPLIT_WORDS = 1024
MAX_SPLIT = _native.MAX_ROW_SPLIT  # the meeting's slots a row (ffi/channel.h Signal::row_shares)


def rows_problem(rows: int, row_bytes: int, cell_bytes: int, max_blocks: int) -> str | None:
  """Why the fused op's Triton kernel cannot take ``rows`` rows of
  ``row_bytes`` on a channel of ``max_blocks`` Lamport cells of
  ``cell_bytes``, or None: it runs a row over one program and block or,
  where the row is large, several (row_split), each holding its part of
  the row of every source. Checked at trace time, so the decision says it,
  and again by rows_plan when lowering."""
  row_words = row_bytes // 4
  if row_bytes % 4 or row_words & (row_words - 1) or row_words > MAX_TILE_WORDS:
    return (f"a row of {row_bytes} bytes is not a power of two of 32-bit words, or above {MAX_TILE_WORDS} "
            "(the Triton kernel's tiles)")
  if row_bytes > cell_bytes or rows > max_blocks:
    return (f"{rows} rows of {row_bytes} bytes do not fit the channel's {max_blocks} Lamport cells of "
            f"{cell_bytes} bytes (a row per cell)")
  return None


def rows_plan(plan: Plan, rows: int, row_bytes: int, dtype: str, site: int) -> Plan | str:
  """The fused op's kernel for ``rows`` rows of ``row_bytes`` of ``dtype``
  at ``site`` on the channel ``plan`` (an all_reduce plan) describes, or
  rows_problem's reason."""
  problem = rows_problem(rows, row_bytes, plan.cell_bytes, plan.max_blocks)
  if problem is not None:
    return problem
  row_words = row_bytes // 4
  split = row_split(rows, row_words, plan.max_blocks)
  return dataclasses.replace(plan, grid=rows * split, block_words=row_words // split, split=split,
                             tag=_native.rows_tag(rows, row_bytes, rows * split, dtype=dtype, site=site))


def row_split(rows: int, row_words: int, max_blocks: int) -> int:
  """Programs per row of the fused op's Triton kernel: 1 below
  SPLIT_ROW_WORDS, else a power of two that leaves each at least
  MIN_SPLIT_WORDS of the row, at most MAX_SPLIT, and the grid within the
  channel's blocks. One program per row leaves most SMs idle at small
  batches, and holds a whole large row of every source."""
  split = 1
  while (row_words >= SPLIT_ROW_WORDS and split < MAX_SPLIT and row_words // (2 * split) >= MIN_SPLIT_WORDS
         and rows * 2 * split <= max_blocks):
    split *= 2
  return split


def _rmsnorm_kernel(plan: Plan, dtype: str, hidden: int, eps: float, warps: int, table_ref, x_ref, residual_ref,
                    weight_ref, normed_ref, residual_out_ref):
  """The fused op (ffi/rmsnorm.h's math) on a row, or a 1/plan.split part
  of one, per program."""
  # Inputs read first have their loads in flight with the exchange's start, not
  # a round trip each after the polls; but a program of SPLIT_ROW_WORDS or more
  # (a 4096-word row where the rows are too many to split, or part of a larger
  # one) would hold them across its polls, and was slower so (64 whole rows of
  # 8192 bfloat16, benchmarks/RESULTS.md 2026-12-06; the other cases are not
  # measured): it reads them where it uses them.
  wide = plan.block_words >= SPLIT_ROW_WORDS
  x_words = x_ref[...]
  residual_words, weight_words = (None, None) if wide else (residual_ref[...], weight_ref[...])
  new = {}  # the new residual: lamport_exchange needs the row's share of squares before the call ends

  def share(cells, rank):  # residual_out = round(sum + residual), one rounding; the norm reads it rounded
    parts = with_own(plan, rank, [x_words] * plan.world, [c for (c,) in cells])
    total = sum_in_rank_order(parts, dtype)
    residual = residual_ref[...] if wide else residual_words
    new["residual"] = to_words(tuple(s + r for s, r in zip(total, to_elements(residual, dtype))), dtype)
    return sum(jnp.sum(v * v) for v in to_elements(new["residual"], dtype))

  done, _, _, sink, squares = lamport_exchange(plan, table_ref, [(x_words,)] * plan.world, warps, share)
  residual_out = new["residual"]
  r = to_elements(residual_out, dtype)
  scale = jax.lax.rsqrt(squares / hidden + eps)
  weight = weight_ref[...] if wide else weight_words
  normed = to_words(tuple(v * scale * w for v, w in zip(r, to_elements(weight, dtype))), dtype)
  failed, nan = failed_outputs(done, sink), jnp.int32(signed_word(NAN_WORDS[dtype]))
  normed_ref[...] = jnp.where(failed, nan, normed)
  residual_out_ref[...] = jnp.where(failed, nan, residual_out)


def residual_rmsnorm(x: jax.Array, residual: jax.Array, weight: jax.Array, row: jax.Array, plan: Plan, *,
                     eps: float, channel: str, poison: bool) -> tuple[jax.Array, jax.Array]:
  """The fused all-reduce, residual add and RMSNorm (ffi/rmsnorm.h) of
  ``x`` [..., hidden] as a Pallas Triton kernel of ``plan`` (rows_plan: a
  row over plan.split programs of a block each). Returns (normed,
  new_residual)."""
  from jax.experimental import pallas as pl

  dtype = np.dtype(x.dtype).name
  W, split = plan.block_words, plan.split  # a program's words: a row's, or its split-th part
  words = as_words(x)
  row_spec = pl.BlockSpec((W,), lambda i: (i,))
  # A program holds a row of every source while it polls: more warps for more words.
  warps = warps_for(W, wide_warps(W * plan.world))
  out = _compat.shape_dtype_like(words)
  normed, new_residual = launch(
      functools.partial(_rmsnorm_kernel, plan, dtype, x.shape[-1], eps, warps), plan, "residual_rmsnorm",
      channel=channel, warps=warps, operands=[row, words, as_words(residual), as_words(weight)],
      in_specs=[table_spec(), row_spec, row_spec, pl.BlockSpec((W,), lambda i: (i % split,))],
      out_shapes=[out, out], out_specs=[row_spec, row_spec], poison_word=signed_word(NAN_WORDS[dtype]) if poison else None)
  return tuple(jax.lax.bitcast_convert_type(y, x.dtype).reshape(x.shape) for y in (normed, new_residual))
