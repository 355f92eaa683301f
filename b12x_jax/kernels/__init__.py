"""The device kernels XLA launches itself: Pallas Triton kernels of the
Lamport exchange (docs/DESIGN.md, "Triton kernels"), one module per op
(all_reduce.py, residual_rmsnorm.py, dcp_a2a.py) on the exchange they share
(exchange.py), which speak ffi/lamport.h's wire protocol word for word, so
Triton and FFI calls interleave on one channel. The only place that imports
Pallas: ``backend_problem`` says whether this jax still has the backend.
Here: which kernel a call gets (``call_for``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from b12x_jax import _native
from b12x_jax.kernels import all_reduce, dcp_a2a, residual_rmsnorm
from b12x_jax.kernels.exchange import (ROW_WORDS, backend_problem, make_plan, plan_problem, region_problem, table_row,
                                       why_not)
from b12x_jax.kernels.residual_rmsnorm import row_split, rows_plan, rows_problem
from b12x_jax.kernels.dcp_a2a import dcp_problem

__all__ = ["ROW_WORDS", "Call", "backend_problem", "call_for", "dcp_problem", "row_split", "rows_plan", "rows_problem",
           "table_row", "why_not"]


class Call(NamedTuple):
  """The Triton kernel of one call: its plan (equal for equal calls: one
  per partition) and ``kernel(row, *args) -> results``."""
  plan: tuple
  kernel: Callable


def call_for(op: str, view: dict, avals, params: dict, *, channel: str, site: int, poison: bool) -> Call | str:
  """The Triton kernel of a call of ``op`` at ``site`` on ``avals`` (with
  the primitive's ``params``) on the channel ``view`` describes, or why it
  cannot run the call."""
  plan = make_plan(view)
  if (problem := region_problem(plan)) is not None:
    return problem
  if op == "dcp_a2a":
    out, _ = avals
    batch, heads, dim = out.shape
    row_bytes = dim * out.dtype.itemsize
    grid, per_block, tag = _native.dcp_lamport_plan(plan.cell_bytes, plan.max_blocks, batch, heads, plan.world,
                                                    row_bytes, dtype=out.dtype.name, site=site,
                                                    base2=bool(params["base2"]))
    problem = dcp_problem(out.dtype, heads, plan.world, row_bytes, grid, per_block)
    if problem is not None:
      return problem
    merge = dict(base2=bool(params["base2"]), return_lse=bool(params["return_lse"]))
    # The FFI kernel's grid and tag; a block's words: one source's rows of it.
    dcp = dataclasses.replace(plan, grid=grid, block_words=per_block * row_bytes // 4, tag=tag)
    return Call((dcp, tuple(merge.items())),
                lambda row, out, lse: list(dcp_a2a.dcp_a2a(out, lse, row, dcp, **merge, channel=channel, poison=poison)))
  if op == "all_reduce":
    problem = plan_problem(view)
    if problem is not None:
      return problem
    return Call((plan,), lambda row, x: [all_reduce.all_reduce(x, row, plan, channel=channel, poison=poison)])
  x = avals[0]
  hidden = x.shape[-1]
  fused_plan = rows_plan(plan, int(np.prod(x.shape)) // hidden, hidden * x.dtype.itemsize, x.dtype.name, site)
  if isinstance(fused_plan, str):
    return fused_plan
  eps = float(params["eps"])
  return Call((fused_plan, eps), lambda row, x, residual, weight: list(residual_rmsnorm.residual_rmsnorm(
      x, residual, weight, row, fused_plan, eps=eps, channel=channel, poison=poison)))
