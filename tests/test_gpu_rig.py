"""The one-GPU rig: 2 to 8 jax.distributed processes that all take GPU 0
form a mesh of distinct devices, and b12x runs between them over CUDA IPC on
the one GPU, under MPS (conftest's ``gpu_rig``). The multi-process cases of
tests/test_multiprocess.py, through the same worker modes, on CUDA at every
world size: values against float64 with poisoned outputs, CUDA graphs on and
off, a rank that never calls, the drop-in cases (AD, vmap, packed pytrees). Marked gpu_rig; skipped, with the reason,
without a GPU, a CUDA build or MPS."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import expected_taken
from mp_workers import FUSED_CASES
from test_multiprocess import (ALL_REDUCE_CONFIGS, BARRIER_MISMATCHES, MISMATCHED_CALLS, REPREPARED, REPREPARED_IDS,
                               check_all_reduce_configs, check_capacity_edge, check_dcp, check_drop_in,
                               check_every_op, check_fused_bits, check_loops, check_misplaced, check_mismatch,
                               check_never_calls, check_reprepared, dcp_options)

pytestmark = pytest.mark.gpu_rig
WORLDS = [2, 4, 8]
# XLA's command buffers (CUDA graphs) off: the flag with no command types.
GRAPHS_OFF = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}


@pytest.mark.parametrize("graphs", ["on", "off"])
@pytest.mark.parametrize("n", WORLDS)
def test_all_reduce_on_the_lamport_and_barrier_paths_of_each_algorithm_matches_float64(gpu_rig, n, graphs):
  results = gpu_rig("all_reduce", n, "--configs", json.dumps(ALL_REDUCE_CONFIGS),
                    env=GRAPHS_OFF if graphs == "off" else None)
  check_all_reduce_configs(results)


@pytest.mark.parametrize("graphs", ["on", "off"])
def test_a_failed_execution_leaves_later_calls_right(gpu_rig, graphs):
  assert gpu_rig("after_failure", 2, env=GRAPHS_OFF if graphs == "off" else None) == [{"checked": True}] * 2


@pytest.mark.parametrize("kernels", ["ffi", "triton"])
def test_payloads_at_the_capacity_of_a_grid_that_does_not_divide_it_run_right(gpu_rig, kernels):
  check_capacity_edge(gpu_rig("capacity_edge", 2, communicator={"kernels": kernels}))


@pytest.mark.parametrize("kernels", ["ffi", "triton"])
@pytest.mark.parametrize("protocol", ["lamport", "barrier"])
@pytest.mark.parametrize("n", WORLDS)
def test_dcp_a2a_matches_float64_full_attention_across_the_wrap(gpu_rig, n, protocol, kernels):
  if protocol == "barrier" and kernels == "triton":
    pytest.skip("the barrier protocol has no Triton kernel")
  results = gpu_rig("dcp", n, "--wrap", communicator=json.loads(dcp_options(protocol, kernels=kernels)))
  check_dcp(results, wrap=True, protocol=protocol, triton=kernels == "triton" and protocol == "lamport")


@pytest.mark.parametrize("n", WORLDS)
def test_the_triton_dcp_merge_runs_with_cuda_graphs_off(gpu_rig, n):
  results = gpu_rig("dcp", n, env=GRAPHS_OFF, communicator=json.loads(dcp_options("lamport", kernels="triton")))
  check_dcp(results, wrap=False, protocol="lamport", triton=True)


@pytest.mark.parametrize("n", WORLDS)
def test_the_fused_op_matches_float64_with_identical_bits(gpu_rig, n):
  check_fused_bits(gpu_rig("residual_rmsnorm", n, communicator={"poison_outputs": True}))


@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_worlds_below_the_unrolled_sources_run_the_ffi_lamport_kernels_right(gpu_rig, n):
  """A world that is not a power of two: every FFI Lamport kernel runs
  unrolled to the next one (4 sources for 3 ranks, 8 for 5 to 7), the
  sources past the world guarded by it (docs/DESIGN.md, "Lamport"); the
  same cases as on CPU (test_multiprocess.py, 3 processes)."""
  check_every_op(lambda mode, *args, communicator=None: gpu_rig(mode, n, *args, communicator=communicator))


@pytest.mark.parametrize("graphs", ["on", "off"])
@pytest.mark.parametrize("kernels", ["ffi", "triton"])
@pytest.mark.parametrize("n", WORLDS)
def test_the_fused_op_matches_float64_with_identical_bits_across_the_wrap(gpu_rig, n, kernels, graphs):
  results = gpu_rig("residual_rmsnorm", n, "--wrap", env=GRAPHS_OFF if graphs == "off" else None,
                    communicator={"poison_outputs": True, "kernels": kernels, "timeout_s": 5.0,
                                  "setup_timeout_s": 20.0})
  check_fused_bits(results)
  cases = 3 * len(FUSED_CASES)  # dtypes x shapes, twice: from 5 before the wrap, the split rows' meeting words too
  # Every call shares the channel's counters (with kernels="triton", the FFI float16 ones too).
  assert {r["epoch"] for r in results} == {(2 * (2**32 - 5) + 2 * cases) % 2**32}, results  # both counters wrapped
  for case, kinds in results[0]["kernels"].items():  # float16 has no Triton kernel: the FFI one ran it
    assert kinds == (["ffi"] if case.startswith("float16") or kernels == "ffi" else ["triton"]), (case, kinds)


@pytest.mark.parametrize("n", WORLDS)
def test_the_drop_in_cases_match_float64(gpu_rig, n):
  # grad, jvp, vmap of each op, a packed pytree on CUDA; the psum cases (NCCL: not on one GPU) only lowered
  check_drop_in(gpu_rig("drop_in", n), rig=True)


@pytest.mark.parametrize("op", ["all_reduce", "dcp_a2a", "residual_rmsnorm"])
@pytest.mark.parametrize("n", WORLDS)
def test_a_rank_that_never_calls_gives_the_others_the_timeout_error_and_nan(gpu_rig, n, op):
  check_never_calls(gpu_rig("never_calls", n, "--timeout", "2", "--op", op), "2", "cuda")


@pytest.mark.parametrize("graphs", ["on", "off"])
@pytest.mark.parametrize("n", WORLDS)
def test_independent_calls_on_one_channel_run_in_program_order(gpu_rig, n, graphs):
  # Graphs on: XLA captures the calls in a CUDA graph, whose commands it
  # orders by its schedule, which follows the channel's token.
  for r in gpu_rig("independent", n, env=GRAPHS_OFF if graphs == "off" else None, hard_timeout=240):
    assert r == {"wrong": 0, "results": 20 * 32, "taken": expected_taken("all_reduce", "lamport")}, r


@pytest.mark.parametrize("kernels", ["ffi", "triton"])
@pytest.mark.parametrize("op", ["dcp_a2a", "residual_rmsnorm"])
def test_independent_merges_and_fused_calls_run_in_program_order(gpu_rig, op, kernels):
  for r in gpu_rig("independent", 2, "--op", op, communicator={"kernels": kernels}, hard_timeout=240):
    assert r == {"wrong": 0, "results": 20 * 32, "taken": expected_taken(op, "lamport", kernels)}, r


@pytest.mark.parametrize("graphs", ["on", "off"])
@pytest.mark.parametrize("n", [2, 4])
def test_calls_of_back_to_back_executables_and_of_consecutive_shard_maps_run_in_one_order(gpu_rig, n, graphs):
  for r in gpu_rig("dispatch_order", n, env=GRAPHS_OFF if graphs == "off" else None, hard_timeout=240):
    assert r == {"wrong": 0, "results": 10 * 12}, r


def test_a_process_that_reaches_its_first_call_15_s_late_is_waited_for(gpu_rig):
  results = gpu_rig("late_start", 2, "--timeout", "2", "--setup-timeout", "40", "--late", "15", hard_timeout=180)
  assert results[0]["hashes"] == results[1]["hashes"] and results[0]["seconds"] > 10, results


SANITIZER = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"


@pytest.mark.skipif(not shutil.which(SANITIZER), reason=f"compute-sanitizer not found ({SANITIZER})")
@pytest.mark.parametrize("graphs", ["on", "off"])
def test_cached_executables_across_release_and_prepare_touch_no_freed_memory(gpu_rig, graphs, tmp_path):
  # memcheck does not run under MPS: the two processes time-slice GPU 0 (slow, still right).
  env = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/b12x-no-mps", **(GRAPHS_OFF if graphs == "off" else {})}
  launcher = (SANITIZER, "--tool", "memcheck", "--error-exitcode", "97", "--print-limit", "20",
              "--log-file", str(tmp_path / "memcheck.%p.log"))
  results = gpu_rig("reprepare", 2, env=env, launcher=launcher, hard_timeout=400)
  check_reprepared(results, "all_reduce", {})
  logs = [log.read_text() for log in tmp_path.glob("memcheck.*.log")]
  assert len(logs) >= 2 and all("ERROR SUMMARY: 0 errors" in log for log in logs), logs  # memcheck ran, found none


@pytest.mark.parametrize("op, options", [case for case in REPREPARED if case != ("all_reduce", {})],
                         ids=[i for case, i in zip(REPREPARED, REPREPARED_IDS) if case != ("all_reduce", {})])
def test_cached_executables_of_every_protocol_stay_right_across_release_and_prepare(gpu_rig, op, options):
  # Replayed from their graphs; the all_reduce's default run is the memcheck test's above.
  check_reprepared(gpu_rig("reprepare", 2, "--op", op, communicator=options), op, options)


@pytest.mark.parametrize("n", WORLDS)
def test_the_lamport_and_barrier_paths_are_right_across_the_counter_wrap(gpu_rig, n):
  results = gpu_rig("wrap", n)
  assert all(r["hashes"] == results[0]["hashes"] for r in results) and len(results[0]["hashes"]) == 24, results
  assert {r["epoch"] for r in results} == {(2 * (2**32 - 5) + 24) % 2**32}, results  # both counters wrapped


@pytest.mark.parametrize("graphs", ["on", "off"])
@pytest.mark.parametrize("n", WORLDS)
def test_the_triton_kernel_matches_float64_the_ffi_bits_and_interleaves_with_ffi_calls(gpu_rig, n, graphs):
  results = gpu_rig("triton", n, env=GRAPHS_OFF if graphs == "off" else None, hard_timeout=240,
                    communicator={"timeout_s": 5.0, "setup_timeout_s": 20.0})  # a failure fails fast
  assert all(r["hashes"] == results[0]["hashes"] for r in results) and len(results[0]["hashes"]) == 17, results
  assert {r["epoch"] for r in results} == {(2 * (2**32 - 5) + 10) % 2**32}, results  # both counters wrapped


@pytest.mark.parametrize("op", ["all_reduce", "dcp_a2a", "residual_rmsnorm"])  # the fused op's row split
@pytest.mark.parametrize("n", WORLDS)
def test_a_rank_that_never_calls_the_triton_kernel_gives_the_others_the_timeout_error_and_nan(gpu_rig, n, op):
  results = gpu_rig("never_calls", n, "--timeout", "2", "--op", op, communicator={"kernels": "triton"})
  check_never_calls(results, "2", "cuda")
  assert all(r["kernels"] == ["triton"] for r in results), results


@pytest.mark.parametrize("graphs", ["on", "off"])
def test_a_graph_captured_before_a_release_stops_with_the_stale_error_never_runs_on_the_new_memory(gpu_rig, graphs):
  # Where the handler runs again it takes the new view: right. Where XLA
  # replays the captured kernel without it, the view is the old
  # preparation's: NaN and the stale error. jax 0.11.2 on one H200 ran the
  # handler again also with graphs on (2026-12-03), so this reaches the
  # kernel's stale check only on a jax that replays; never a wrong number.
  results = gpu_rig("stale_replay", 2, env=GRAPHS_OFF if graphs == "off" else None)
  for r in results:
    for size, got in r.items():
      stale = [m for m in got["messages"] if "an executable lowered for an earlier preparation" in m]
      assert (got["right"] and not got["messages"]) or (not got["right"] and stale), (size, got)
      if graphs == "off":
        assert got["right"], (size, got)


@pytest.mark.parametrize("n", [2, 4])
def test_an_export_called_with_its_devices_in_other_positions_stops_every_rank_with_nan(gpu_rig, n):
  # The exported module takes the FFI kernel whatever `kernels` says (it
  # must not carry this process's addresses); "triton" proves it.
  check_misplaced(gpu_rig("misplaced_export", n, "--timeout", "5", communicator={"kernels": "triton"}))


@pytest.mark.parametrize("op", sorted(MISMATCHED_CALLS))
@pytest.mark.parametrize("kernels", ["ffi", "triton"])
@pytest.mark.parametrize("n", [2, 4])
def test_processes_at_different_calls_stop_with_the_tag_error_and_nan(gpu_rig, n, kernels, op):
  results = gpu_rig("mismatch", n, "--timeout", "2", "--op", op, communicator={"kernels": kernels})
  check_mismatch(results, op)
  assert all(r["kernels"] == [kernels] for r in results), results


@pytest.mark.parametrize("op, algorithm", BARRIER_MISMATCHES)
def test_processes_at_different_calls_on_the_barrier_protocols_stop_with_the_tag_error_and_nan(gpu_rig, op, algorithm):
  results = gpu_rig("mismatch", 2, "--timeout", "2", "--op", op,
                    communicator={"lamport_bytes": 0, "algorithm": algorithm})
  check_mismatch(results, op, algorithm)


@pytest.mark.parametrize("poison", [False, True])
@pytest.mark.parametrize("kernels", ["ffi", "triton"])
@pytest.mark.parametrize("n", WORLDS)
def test_calls_inside_a_loop_on_two_channels_match_float64(gpu_rig, n, kernels, poison):
  # As a decode loop makes them (examples/speculative_decoding.py's Triton variant fails on the rig:
  # benchmarks/RESULTS.md); the other modes run straight-line programs with poisoned outputs.
  results = gpu_rig("loops", n, communicator={"kernels": kernels, "poison_outputs": poison, "timeout_s": 5.0,
                                              "setup_timeout_s": 20.0})
  check_loops(results, [f"all_reduce {kernels}", f"all_reduce_residual_rmsnorm {kernels}"])
