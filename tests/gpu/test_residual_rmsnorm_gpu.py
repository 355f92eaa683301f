"""all_reduce_residual_rmsnorm on 2 CUDA GPUs of one process (marked gpu;
skipped below 2). Value tests run with ``poison_outputs``."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import b12x_jax
from conftest import requires_2_gpus, run_worker
from helpers import DTYPES, check_residual_rmsnorm_case, fresh_communicator

pytestmark = [pytest.mark.gpu, requires_2_gpus]
N = 2


def _mesh():
  return jax.make_mesh((N,), ("x",), devices=jax.devices("gpu")[:N])


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("rows, hidden", [(1, 4096), (8, 4096), (64, 4096), (1, 8192), (16, 8192), (64, 8192),
                                          (100, 1024), (3, 8)])
def test_fused_op_matches_float64_on_every_rank(dtype_name, rows, hidden):
  rng = np.random.default_rng(rows * hidden)
  with fresh_communicator(poison_outputs=True) as comm, b12x_jax.channel("fused"):
    for _ in range(3):  # fresh inputs each call, through all three Lamport buffers
      check_residual_rmsnorm_case(_mesh(), rng, rows, hidden, dtype_name)
    row_bytes = hidden * np.dtype(DTYPES[dtype_name]).itemsize
    fused = any(d.op == "all_reduce_residual_rmsnorm" and d.path == "b12x" for d in comm.decisions)
    assert fused == (-(-rows // 64) * row_bytes <= (1 << 20) // 64 and row_bytes % 16 == 0), comm.decisions[-1]
  b12x_jax.check_errors()


def test_fused_calls_with_changing_row_counts_share_the_lamport_buffers_right():
  rng = np.random.default_rng(11)
  with fresh_communicator(poison_outputs=True), b12x_jax.channel("mixed"):
    for i in range(60):
      check_residual_rmsnorm_case(_mesh(), rng, 1 + i % 16, 4096, "bfloat16")
  b12x_jax.check_errors()


def test_a_peer_that_never_joins_a_fused_call_raises_the_timeout_error_and_leaves_nan():
  result = run_worker("timeout", "--platform", "gpu", "--op", "residual_rmsnorm", "--timeout", "1.0", hard_timeout=120)
  assert len(result["messages"]) == 2, result
  for message in result["messages"]:
    assert "channel 'lonely'" in message and "rank 0" in message and "rank 1" in message and "epoch" in message
  assert result["nan_outputs"] == [True], result  # normed of the timed-out kernel, never a stale number
