"""dcp_a2a in the Lamport window as a Pallas Triton kernel: each program
exchanges its rows of every destination's head shard with their lse and
merges the sources' partials by their lse (docs/DESIGN.md, "DCP in the
Lamport window")."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from b12x_jax import _compat
from b12x_jax.kernels.exchange import (MAX_TILE_WORDS, NAN_WORDS, Plan, U32, backend_problem, failed_outputs, halves,
                                       lamport_exchange, launch, signed_word, table_spec, to_words, wide_warps,
                                       with_own)


def dcp_problem(dtype, heads: int, world: int, row_bytes: int, grid: int, per_block: int) -> str | None:
  """Why the Triton kernel cannot take a dcp_a2a call of out [B, heads,
  row_bytes] over ``world`` ranks that ffi/dcp.h plan_dcp_lamport plans as
  ``grid`` blocks of ``per_block`` rows (``_native.dcp_lamport_plan``), or
  None: it runs that plan where a block's rows are a power of two of one
  batch row's heads, as tiles. Checked at trace time and by call_for."""
  if backend_problem() is not None:
    return backend_problem()
  if np.dtype(dtype).name != "bfloat16":
    return f"no Triton kernel for dcp_a2a of dtype {np.dtype(dtype).name} (bfloat16 only)"
  if grid == 0:
    return "the rows do not fit the channel's Lamport cells (the barrier protocol takes the call)"
  row_words = row_bytes // 4
  shard_heads = heads // world
  if shard_heads % per_block or per_block & (per_block - 1) or row_words & (row_words - 1):
    return (f"blocks of {per_block} rows of {row_bytes} bytes ({shard_heads} heads per rank) are not "
            "power-of-two tiles of one batch row's heads (the Triton kernel's)")
  cell_words = 4 * -(-(per_block * row_words + per_block) // 4)  # the rows, their lse, the pad (lamport_exchange)
  if cell_words > MAX_TILE_WORDS:
    return (f"a block of {per_block} rows of {row_bytes} bytes and their lse exceeds the Triton kernel's tiles "
            f"of {MAX_TILE_WORDS} words")
  return None


def _dcp_kernel(plan: Plan, rows: int, base2: bool, return_lse: bool, warps: int, table_ref, *refs):
  """The DCP merge (ffi/dcp.h's math) of one block's ``rows`` result rows:
  ``refs`` are every destination's input rows [rows, row words] and lse
  [rows] (int32 bits), then the merged rows (and lse)."""
  world = plan.world
  x_refs, lse_refs, outputs = refs[:world], refs[world:2 * world], refs[2 * world:]
  xs, lses = [ref[...] for ref in x_refs], [ref[...] for ref in lse_refs]
  done, cells, rank, sink, _ = lamport_exchange(plan, table_ref, list(zip(xs, lses)), warps)
  payloads = with_own(plan, rank, xs, [cell[0] for cell in cells])
  lse_bits = with_own(plan, rank, lses, [cell[1] for cell in cells])
  # merge_weights: a source whose lse is not finite has weight 0, and its payload is never summed.
  finite = [(bits & 0x7F800000) != 0x7F800000 for bits in lse_bits]
  lse = [jax.lax.bitcast_convert_type(bits, jnp.float32) for bits in lse_bits]
  m = jnp.full((rows,), -jnp.inf, jnp.float32)
  for f, value in zip(finite, lse):
    m = jnp.where(jnp.logical_and(f, value > m), value, m)
  exp, log = (jnp.exp2, jnp.log2) if base2 else (jnp.exp, jnp.log)
  weights = [jnp.where(f, exp(jnp.where(f, value, m) - m), 0.0) for f, value in zip(finite, lse)]
  total = functools.reduce(jnp.add, weights)
  some = total > 0
  per_word = lambda v: jax.lax.broadcast_in_dim(v, xs[0].shape, (0,))  # noqa: E731  # a row's value on its words
  low, high = jnp.zeros(xs[0].shape, jnp.float32), jnp.zeros(xs[0].shape, jnp.float32)
  for w, payload in zip(weights, payloads):  # rank order (C9)
    scale = per_word(jnp.where(some, w / jnp.where(some, total, 1.0), 0.0))
    taken = scale != 0
    part_low, part_high = halves(payload)
    low = low + jnp.where(taken, scale * part_low, 0.0)
    high = high + jnp.where(taken, scale * part_high, 0.0)
  failed = failed_outputs(done, sink)
  outputs[0][...] = jnp.where(failed, jnp.int32(signed_word(NAN_WORDS["bfloat16"])), to_words((low, high), "bfloat16"))
  if return_lse:
    merged = jnp.where(some, m + log(jnp.where(some, total, 1.0)), -jnp.inf)
    outputs[1][...] = jnp.where(failed, jnp.int32(-1), jax.lax.bitcast_convert_type(merged, U32))


def dcp_a2a(out: jax.Array, lse: jax.Array, row: jax.Array, plan: Plan, *, base2: bool, return_lse: bool,
            channel: str, poison: bool) -> list[jax.Array]:
  """The DCP merge of ``out`` [B, H, D] (bfloat16) and ``lse`` [B, H] as a
  Pallas Triton kernel of ``plan`` (call_for's): program i takes the FFI
  kernel's block i, a run of one batch row's heads. Returns [merged out]
  (and the merged lse)."""
  from jax.experimental import pallas as pl

  batch, heads, dim = out.shape
  world = plan.world
  row_words = dim // 2
  rows = plan.block_words // row_words  # per block
  runs = heads // world // rows  # blocks per batch row
  words = jax.lax.bitcast_convert_type(out.reshape(batch, world, runs, rows, row_words, 2), U32)
  lse_bits = jax.lax.bitcast_convert_type(lse, U32).reshape(batch, world, runs, rows)
  # One operand per destination: a block's rows of that destination's heads.
  x_specs = [pl.BlockSpec((None, None, None, rows, row_words), lambda i, p=p: (i // runs, p, i % runs, 0, 0))
             for p in range(world)]
  lse_specs = [pl.BlockSpec((None, None, None, rows), lambda i, p=p: (i // runs, p, i % runs, 0)) for p in range(world)]
  out_shapes = [_compat.shape_dtype_like(words, (batch, runs, rows, row_words))]
  out_specs = [pl.BlockSpec((None, None, rows, row_words), lambda i: (i // runs, i % runs, 0, 0))]
  if return_lse:
    out_shapes.append(_compat.shape_dtype_like(words, (batch, runs, rows)))
    out_specs.append(pl.BlockSpec((None, None, rows), lambda i: (i // runs, i % runs, 0)))
  warps = wide_warps(plan.block_words * world)
  results = launch(functools.partial(_dcp_kernel, plan, rows, base2, return_lse, warps), plan, "dcp_a2a",
                    channel=channel, warps=warps, operands=[row, *[words] * world, *[lse_bits] * world],
                    in_specs=[table_spec(), *x_specs, *lse_specs], out_shapes=out_shapes, out_specs=out_specs,
                    poison_word=-1 if poison else None)
  merged = jax.lax.bitcast_convert_type(results[0], jnp.bfloat16).reshape(batch, heads // world, dim)
  if not return_lse:
    return [merged]
  return [merged, jax.lax.bitcast_convert_type(results[1], jnp.float32).reshape(batch, heads // world)]
