"""The one-GPU rig: 2, 4 and 8 jax.distributed processes that all take GPU 0
form a mesh of distinct devices, and b12x runs between them over CUDA IPC on
the one GPU, under MPS (conftest's ``gpu_rig``). The multi-process cases of
tests/test_multiprocess.py, through the same worker modes, on CUDA at every
world size: values against float64 with poisoned outputs, CUDA graphs on and
off, a rank that never calls. Marked gpu_rig; skipped, with the reason,
without a GPU, a CUDA build or MPS."""

from __future__ import annotations

import json

import pytest

from test_multiprocess import ALL_REDUCE_CONFIGS, check_all_reduce_configs, check_never_calls

pytestmark = pytest.mark.gpu_rig
WORLDS = [2, 4, 8]
# XLA's command buffers (CUDA graphs) off: the flag with no command types.
GRAPHS_OFF = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}


@pytest.mark.parametrize("graphs", ["on", "off"])
@pytest.mark.parametrize("n", WORLDS)
def test_all_reduce_on_the_lamport_and_barrier_paths_of_each_algorithm_matches_float64(gpu_rig, n, graphs):
  results = gpu_rig("all_reduce", n, "--configs", json.dumps(ALL_REDUCE_CONFIGS),
                    env=GRAPHS_OFF if graphs == "off" else None)
  check_all_reduce_configs(results, "cuda")


@pytest.mark.parametrize("n", WORLDS)
def test_dcp_a2a_matches_float64_full_attention(gpu_rig, n):
  results = gpu_rig("dcp", n, communicator={"poison_outputs": True})
  assert [r["rank"] for r in results] == list(range(n)) and {r["epoch"] for r in results} == {2}, results


@pytest.mark.parametrize("n", WORLDS)
def test_the_fused_op_matches_float64_with_identical_bits(gpu_rig, n):
  results = gpu_rig("residual_rmsnorm", n, communicator={"poison_outputs": True})
  assert all(r["hashes"] == results[0]["hashes"] for r in results) and len(results[0]["hashes"]) == 9


@pytest.mark.parametrize("n", WORLDS)
def test_a_rank_that_never_calls_gives_the_others_the_timeout_error_and_nan(gpu_rig, n):
  check_never_calls(gpu_rig("never_calls", n, "--timeout", "2"), "2", "cuda")
