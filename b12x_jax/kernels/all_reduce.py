"""all_reduce in the Lamport window as a Pallas Triton kernel: each
program exchanges its block (exchange.lamport_exchange) and sums every
source's words in rank order, fp32, rounded once."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from b12x_jax import _compat
from b12x_jax.kernels.exchange import (NAN_WORDS, Plan, as_words, failed_outputs, lamport_exchange, launch,
                                       signed_word, sum_in_rank_order, table_spec, to_words, warps_for, with_own)


def _all_reduce_kernel(plan: Plan, dtype: str, warps: int, table_ref, x_ref, y_ref):
  x_words = x_ref[...]
  done, cells, rank, sink, _ = lamport_exchange(plan, table_ref, [(x_words,)] * plan.world, warps)
  parts = with_own(plan, rank, [x_words] * plan.world, [c for (c,) in cells])
  total = to_words(sum_in_rank_order(parts, dtype), dtype)
  y_ref[...] = jnp.where(failed_outputs(done, sink), jnp.int32(signed_word(NAN_WORDS[dtype])), total)


def all_reduce(x: jax.Array, row: jax.Array, plan: Plan, *, channel: str, poison: bool) -> jax.Array:
  """The Triton Lamport all_reduce of ``x`` (float32 or bfloat16) on the
  channel whose table ``row`` (this device's) and ``plan`` were baked at
  lowering. The kernel moves and returns 32-bit words, as the wire does."""
  from jax.experimental import pallas as pl

  dtype = np.dtype(x.dtype).name
  flat = as_words(x)
  spec = pl.BlockSpec((plan.block_words,), lambda i: (i,))
  warps = warps_for(plan.block_words, 4 if plan.block_words <= 1024 else 8)
  (y,) = launch(functools.partial(_all_reduce_kernel, plan, dtype, warps), plan, "all_reduce", channel=channel,
                 warps=warps, operands=[row, flat], in_specs=[table_spec(), spec],
                 out_shapes=[_compat.shape_dtype_like(flat)], out_specs=[spec],
                 poison_word=signed_word(NAN_WORDS[dtype]) if poison else None)
  return jax.lax.bitcast_convert_type(y, x.dtype).reshape(x.shape)
