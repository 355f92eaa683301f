"""One process per device with jax.distributed, on the CPU backend (POSIX
shared memory between processes): the same preparation, rendezvous and
teardown code as CUDA IPC on GPUs (docs/DESIGN.md, "Transports"; C4, C11). Each test runs 2
worker processes (tests/mp_workers.py) with a hard timeout."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest
from helpers import INDEPENDENT_OPS, expected_taken, mount_namespace, tag_error

import b12x_jax
from b12x_jax import rendezvous


def test_all_reduce_across_processes_matches_float64_with_identical_bits(multiprocess):
  results = multiprocess("all_reduce")
  assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {2}
  assert results[0]["hashes"] == results[1]["hashes"]  # each process checked its values against float64
  assert [r["epochs"] for r in results] == [[8], [8]]


# The Lamport window, then each algorithm of the barrier path, outputs
# poisoned; and the epochs each ends at (4 sizes times 2 calls; a two-shot
# call counts two), the same on CPU and CUDA: one protocol (docs/DESIGN.md).
ALL_REDUCE_CONFIGS = [{"poison_outputs": True}] + [
    {"lamport_bytes": 0, "algorithm": a, "poison_outputs": True} for a in ("one_shot", "two_shot", "one_shot_pull")]
ALL_REDUCE_EPOCHS = [8, 8, 16, 8]


def check_all_reduce_configs(results: list[dict]) -> None:
  """all_reduce mode under ALL_REDUCE_CONFIGS: every process checked its
  values against float64, and all hold identical bits."""
  assert [r["rank"] for r in results] == list(range(len(results))), results
  assert all(r["hashes"] == results[0]["hashes"] for r in results) and len(results[0]["hashes"]) == 16
  assert [r["epochs"] for r in results] == [ALL_REDUCE_EPOCHS] * len(results)


def test_all_reduce_across_processes_under_each_algorithm_matches_float64(multiprocess):
  check_all_reduce_configs(multiprocess("all_reduce", 2, "--configs", json.dumps(ALL_REDUCE_CONFIGS)))


def check_capacity_edge(results: list[dict]) -> None:
  """capacity_edge mode: each payload at its limit ran on b12x, right on every process."""
  for r in results:
    assert [("one_shot (" in p, "within the Lamport window" in p) for p in r["paths"]] == [(True, False),
                                                                                         (False, True)], r


def test_payloads_at_the_capacity_and_at_the_lamport_window_run_right(multiprocess):
  check_capacity_edge(multiprocess("capacity_edge", 2))


def test_a_failed_execution_across_processes_leaves_later_calls_right(multiprocess):
  assert multiprocess("after_failure", 2) == [{"checked": True}] * 2


def check_fused_bits(results: list[dict]) -> None:
  """residual_rmsnorm mode's results: every process checked each call
  against float64 and hashed its outputs: every process the same bits, for
  every case."""
  from mp_workers import FUSED_CASES
  assert all(r["hashes"] == results[0]["hashes"] for r in results) and len(results[0]["hashes"]) == 3 * len(FUSED_CASES)


def check_every_op(run) -> None:
  """all_reduce (every configuration), dcp_a2a on the Lamport path across
  the wrap and the fused op, each against float64, where ``run(mode, *args,
  communicator=None)`` runs a worker mode in every process."""
  check_all_reduce_configs(run("all_reduce", "--configs", json.dumps(ALL_REDUCE_CONFIGS)))
  check_dcp(run("dcp", "--wrap", communicator=json.loads(dcp_options("lamport"))), wrap=True, protocol="lamport")
  check_fused_bits(run("residual_rmsnorm", communicator={"poison_outputs": True}))


def test_the_fused_op_across_processes_matches_float64_with_identical_bits(multiprocess):
  check_fused_bits(multiprocess("residual_rmsnorm", 2, "--communicator", json.dumps({"poison_outputs": True})))


def test_three_processes_match_float64_on_every_op(multiprocess):
  """A world that is not a power of two (the CUDA Lamport kernels take it
  unrolled to 4 sources: the rig runs the same on a GPU)."""
  check_every_op(lambda mode, *args, communicator=None: multiprocess(
      mode, 3, *args, *(["--communicator", json.dumps(communicator)] if communicator else [])))


@pytest.mark.parametrize("op", ["all_reduce", "dcp_a2a", "residual_rmsnorm"])
@pytest.mark.parametrize("n", [2, 3])
def test_a_process_that_prepared_but_never_calls_gives_the_others_the_timeout_error(multiprocess, n, op):
  results = multiprocess("never_calls", n, "--timeout", "2", "--op", op)
  check_never_calls(results, "2", "cpu")


def test_counters_wrap_across_processes_with_the_same_results(multiprocess):
  results = multiprocess("wrap")
  assert results[0]["hashes"] == results[1]["hashes"]  # each process checked its values against float64
  # Barrier and Lamport counters both started at 2**32 - 5 and ran 12 calls each.
  assert {r["epoch"] for r in results} == {(2 * (2**32 - 5) + 24) % 2**32}


def dcp_options(protocol: str, **options) -> str:
  """dcp mode's --communicator: poisoned outputs, and with protocol
  "barrier" no Lamport window (every call on the barrier protocol)."""
  return json.dumps({"poison_outputs": True, **({"lamport_bytes": 0} if protocol == "barrier" else {}), **options})


def check_dcp(results: list[dict], wrap: bool, protocol: str, triton: bool = False) -> None:
  """dcp mode's results: every rank checked its calls and counted them
  alike (from 5 below the wrap with ``wrap``: both counters crossed it);
  every call took ``protocol``: "barrier" (lamport_bytes=0) or "lamport"
  (every DCP_CASES shape fits the Lamport cells, also B = 67 on CUDA's 64
  blocks: two batch rows per block); with ``triton``, bfloat16 calls of
  B <= 8 (a block per batch row's heads on the rig's blocks) ran the
  Triton kernel and the rest the FFI one (one decision per shape and
  variant: each executable is traced once), else all the FFI one."""
  from mp_workers import DCP_CASES, DCP_VARIANTS
  calls = len(DCP_VARIANTS) * len(DCP_CASES)
  assert [r["rank"] for r in results] == list(range(len(results))), results
  assert {r["epoch"] for r in results} == {(2 * (2**32 - 5) + calls) % 2**32 if wrap else calls}, results
  assert len(results[0]["kernels"]) == len(DCP_CASES), results[0]
  for case, kinds in results[0]["kernels"].items():
    dtype, shape = case.split("/")
    decode_sized = int(shape.split("x")[0]) <= 8
    takes_triton = triton and dtype == "bfloat16" and decode_sized
    assert kinds == ["triton" if takes_triton else "ffi"] * len(DCP_VARIANTS), (case, kinds)  # each variant's
    assert results[0]["protocols"][case] == [protocol] * len(DCP_VARIANTS), (case, results[0]["protocols"])


@pytest.mark.parametrize("wrap", [False, True], ids=["", "across-the-wrap"])
@pytest.mark.parametrize("protocol", ["lamport", "barrier"])
def test_dcp_a2a_across_processes_matches_full_attention(multiprocess, protocol, wrap):
  results = multiprocess("dcp", 2, "--communicator", dcp_options(protocol), *(["--wrap"] if wrap else []))
  check_dcp(results, wrap, protocol)


def test_channels_requested_in_different_orders_still_pair_by_name(multiprocess):
  results = multiprocess("order")
  assert results[0]["hashes"] == results[1]["hashes"]
  for r in results:
    assert r["prepared"] == ["alpha", "beta", "gamma"] and r["epochs"] == {"alpha": 1, "beta": 1, "gamma": 1}


def test_a_failed_preparation_on_one_process_makes_all_raise_with_nothing_mapped(multiprocess):
  results = multiprocess("failed_prepare")
  for r in results:
    assert re.search(r"step 'allocated' failed on 1 of 2 processes.*process 0: injected failure at allocated",
                     r["errors"]["allocated"]), r
    assert re.search(r"step 'opened' failed on 1 of 2 processes.*process 1: .*injected failure at opened",
                     r["errors"]["opened"]), r
  assert results[0]["hash"] == results[1]["hash"]  # and the channel prepares fine afterwards


@pytest.fixture
def small_dev_shm():
  """A mount namespace whose /dev/shm is a tmpfs of 32 MiB (Docker's default
  is 64): the command prefix that runs a process in it."""
  with mount_namespace("mount -t tmpfs -o size=32m tmpfs /dev/shm", "a small /dev/shm") as enter:
    yield enter


def test_a_dev_shm_too_small_for_a_channel_is_a_clear_error_and_a_smaller_capacity_runs(multiprocess, small_dev_shm):
  # The segment was sized, not reserved: the first touch of a page tmpfs could not back raised SIGBUS.
  results = multiprocess("small_shm", 2, launcher=small_dev_shm)
  for me, r in enumerate(results):
    assert re.search(rf"channel 'default-size': rank {me}'s shared-memory segment of \d+ MiB does not fit in "
                     r"/dev/shm \(No space left on device, \d+ MiB free there\): lower capacity_bytes .* or give "
                     r"/dev/shm more room \(docker run --shm-size\)", r["error"] or ""), r
    assert r["left"] == [], r
  assert results[0]["hash"] == results[1]["hash"]


def test_throwaway_channels_in_a_loop_reuse_the_memory_of_the_first_across_processes(multiprocess):
  for r in multiprocess("reuse_cycles", 2, "--cycles", "100", hard_timeout=300):
    assert r["mapped"][0] > 0 and r["mapped"] == [r["mapped"][0]] * 100, r


def test_a_process_that_dies_preparing_leaves_no_shared_memory_name(multiprocess):
  survivor, _ = multiprocess("dies_preparing", 2, "--setup-timeout", "2", killed=(1,))
  assert survivor["message"] and "timed out" in survivor["message"], survivor
  assert survivor["left"] == [], survivor


def test_a_timeout_names_the_step_the_missing_process_waits_in(multiprocess):
  # Processes preparing different channels each blamed the other as if it
  # were absent.
  results = multiprocess("elsewhere", 2, "--setup-timeout", "2")
  for me, r in enumerate(results):
    other = ("target", "draft")[1 - me]
    assert re.search(rf"process {1 - me} did not report \(the last b12x_jax step it entered: "
                     rf"prepare/cpu/{other}/\S+ #1, step 'reusable'\)", r["message"]), r


def test_processes_that_met_at_different_channels_time_out_together_and_then_run(multiprocess):
  # Each process numbers its sessions of a channel. A process that arrived after its peer had given
  # up took the peer's word and went on alone (an agreement passed in one process, failed in the
  # other); from then on the two paired different sessions and every later call timed out.
  results = multiprocess("met_apart", 2, "--setup-timeout", "2", hard_timeout=180)
  summed = lambda outcome: len(outcome) == 64  # noqa: E731  # a hash: the sum was right
  first = [r["rounds"][0] for r in results]
  for channel in ("a", "b"):  # ended alike in both: both right (the second, where the first gave up in time), or
    outcomes = [f[channel] for f in first]  # both failed, one of them because its peer gave up on it
    assert outcomes[0] == outcomes[1] if summed(outcomes[0]) else not summed(outcomes[1]), first
  errors = [o for f in first for o in f.values() if not summed(o)]
  assert errors and all(o.startswith("CollectiveTimeoutError: b12x_jax: agree/") for o in errors), first
  assert any(re.search(r"failed in process \d, which arrived after process \d had given up waiting 2 s for it", o)
             for o in errors), first
  for r in results:  # then every call of both rounds in the same order summed right, with identical bits
    assert r["rounds"][1:] == results[0]["rounds"][1:] and all(map(summed, r["rounds"][1].values())), r


@pytest.mark.parametrize("processes", [2, 3])
def test_a_reset_of_reused_memory_that_times_out_fails_everywhere_and_the_next_call_runs(multiprocess, processes):
  # The process whose reset came late kept the group it had revived in use, with no Communicator
  # holding it.
  results = multiprocess("slow_reset", processes, "--setup-timeout", "2", hard_timeout=180)
  for r in results:
    first, reset, *later = r["rounds"]
    assert len(first) == 64 and all(len(h) == 64 for h in later), r  # hashes: right sums
    assert reset.startswith("CollectiveTimeoutError: b12x_jax: prepare/cpu/a/") and "'reset'" in reset, r
  assert all(r["rounds"][2:] == results[0]["rounds"][2:] for r in results)  # identical bits


def test_one_channel_traced_from_two_threads_at_once_agrees_once(multiprocess):
  # Both threads found the channel not yet agreed and each began an agreement: this process counted
  # two sessions where its peer counted one, and one of the compiles timed out.
  for r in multiprocess("threads_trace", 2, "--setup-timeout", "5", hard_timeout=120):
    assert r["errors"] == [], r


def test_two_channels_traced_from_threads_in_opposite_orders_in_two_processes_both_run(multiprocess):
  # One lock for every channel's agreement (or preparation), held while it waits for the peers: each
  # process held it for the channel its peer would take second, and both timed out on both.
  for r in multiprocess("threads_trace", 2, "--setup-timeout", "4", "--op", "all_reduce_site", hard_timeout=120):
    assert r["errors"] == [], r


@pytest.mark.parametrize("processes", [2, 3])
def test_a_process_that_never_joins_gives_the_others_the_timeout_error(multiprocess, processes):
  *waiting, _ = multiprocess("never_joins", processes, "--setup-timeout", "2")
  for p, r in enumerate(waiting):
    assert re.search(rf"prepare/cpu/alone/.*step 'reusable' timed out after 2 s in process {p}: process "
                     rf"{processes - 1} did not report.*every process of the group must make the same calls",
                     r["message"]), r
    # One bound per step, not one per peer: process 0 waited 1.5 s for
    # process 1, then 2 s more for process 2.
    assert r["seconds"] < 3 and r["mapped"] == [], r


def test_close_twice_is_harmless_and_keeps_the_memory_executables_may_point_at(multiprocess):
  for r in multiprocess("close_twice"):
    assert r["closed"] and r["prepared"] == [] and r["left"] == [], r
    assert r["mapped"], r  # kept mapped until exit (DESIGN C16), with no name left in /dev/shm


# reprepare mode's runs, (op, Communicator arguments): the all_reduce under each algorithm above the
# Lamport window, dcp_a2a on either protocol, the fused op fused and on its unfused path.
REPREPARED = [("all_reduce", {}), ("all_reduce", {"algorithm": "two_shot"}),
              ("all_reduce", {"algorithm": "one_shot_pull"}), ("dcp_a2a", {}), ("dcp_a2a", {"lamport_bytes": 0}),
              ("residual_rmsnorm", {}), ("residual_rmsnorm", {"lamport_bytes": 0})]
REPREPARED_IDS = ["-".join([op, *map(str, options.values())]) for op, options in REPREPARED]


def check_reprepared(results: list[dict], op: str, options: dict) -> None:
  """reprepare mode: every call right (checked in the worker), the ranks'
  bits identical where they hold the same result (all but dcp_a2a's head
  shards), the calls on the protocols asked for, and a fresh channel after
  the last prepare."""
  calls = {"all_reduce": 12, "dcp_a2a": 6, "residual_rmsnorm": 6}[op]
  assert all(len(r["hashes"]) == calls for r in results), results
  assert op == "dcp_a2a" or all(r["hashes"] == results[0]["hashes"] for r in results), results
  algorithm = options.get("algorithm", "one_shot")
  if op == "all_reduce":  # 16 KiB within the Lamport window, 2 MiB above it
    want = sorted(expected_taken(op, "lamport") + expected_taken(op, algorithm), key=str)
  else:
    want = expected_taken(op, "lamport" if options.get("lamport_bytes") != 0 else algorithm)
  assert all(r["taken"] == want for r in results), (want, results)
  assert {r["epoch"] for r in results} == {0}, results


@pytest.mark.parametrize("op, options", REPREPARED, ids=REPREPARED_IDS)
def test_cached_executables_stay_right_across_release_and_prepare(multiprocess, op, options):
  check_reprepared(multiprocess("reprepare", 2, "--op", op, "--communicator", json.dumps(options)), op, options)


def test_a_throwaway_channel_is_released_after_success_and_failure_and_prepared_again(multiprocess):
  results = multiprocess("throwaway")
  for r in results:
    assert r["after_success"] == [] and r["after_failure"] == [] and r["failure"] == "profiling failed", r
    assert r["epoch"] == 1  # a fresh channel: its counters start again
  assert results[0]["hash"] == results[1]["hash"]


def test_exit_with_pending_work_releases_collectively_without_crashing_peers(multiprocess):
  assert multiprocess("exit_pending") == [{"dispatched": True}] * 2


def test_a_peer_killed_mid_run_makes_the_survivor_raise_within_the_timeout(multiprocess):
  survivor, killed = multiprocess("killed_peer", 2, "--timeout", "2", killed=(1,))
  assert killed is None and survivor["done"] == 3 and survivor["wrong"] == 0, survivor
  assert re.search(r"channel 'mortal' rank 0 timed out after 2 s at epoch 4 waiting for rank 1",
                   survivor["message"]), survivor
  assert survivor["seconds"] < 2 + 5, survivor


def test_close_after_a_peer_died_waits_one_setup_timeout_not_one_per_channel(multiprocess):
  survivor, _ = multiprocess("close_after_peer_died", 2, "--setup-timeout", "2", killed=(1,))
  assert survivor["error"] == "CollectiveTimeoutError" and survivor["prepared"] == [], survivor
  assert survivor["seconds"] < 2 + 1.5, survivor  # three channels waited 6 s


def _settings(multiprocess, *communicators: dict, env=None) -> list[dict]:
  return multiprocess("settings", len(communicators), "--communicators", json.dumps(communicators), env=env,
                      hard_timeout=60)


@pytest.mark.parametrize("setting, values", [
    ("algorithm", ("two_shot", "one_shot")), ("capacity_bytes", (1 << 20, 2 << 20)),
    ("lamport_bytes", (1 << 20, 0)), ("timeout_s", (2.0, 3.0)), ("max_blocks", (8, 16)),
    ("poison_outputs", (False, True)), ("kernels", ("ffi", "triton"))])
def test_processes_that_disagree_on_a_setting_all_raise_naming_it_and_both_values(multiprocess, setting, values):
  results = _settings(multiprocess, *({setting: v} for v in values))
  want = rf"process 0 has {setting}={values[0]!r}, process 1 has {setting}={values[1]!r}: pass the same " \
         rf"Communicator\({setting}=\.\.\.\) in every process"
  for r in results:
    assert r["error"] == "ChannelError" and re.search(want, r["message"]), r
    assert r["seconds"] < 30 and r["mapped"] == [], r  # no wait for a timeout; nothing left mapped


def test_a_policy_set_by_the_environment_of_one_process_only_makes_both_raise(multiprocess):
  results = _settings(multiprocess, {}, {}, env={1: {"B12X_JAX_POLICY": "strict"}})
  for r in results:
    assert r["error"] == "ChannelError", r
    assert re.search(r"process 0 has policy='auto', process 1 has policy='strict': .*B12X_JAX_POLICY", r["message"]), r


@pytest.mark.parametrize("policies", [("psum", None), (None, "psum"), ("psum", "strict")])
def test_processes_whose_policies_send_them_down_different_paths_all_raise_naming_the_policy(multiprocess, policies):
  # The psum process prepares nothing: without the agreement at trace time
  # it met its peer in Gloo's psum and failed after 30 s naming neither.
  env = {p: {"B12X_JAX_POLICY": policy} for p, policy in enumerate(policies) if policy}
  results = _settings(multiprocess, {}, {}, env=env)
  held = ", ".join(f"process {p} has policy='{policy or 'auto'}'" for p, policy in enumerate(policies))
  for r in results:
    assert r["error"] == "ChannelError", r
    assert re.search(rf"{held}: .*B12X_JAX_POLICY", r["message"]), r
    assert r["seconds"] < 10 and r["mapped"] == [], r


def test_processes_whose_capacities_put_one_call_on_different_paths_all_raise(multiprocess):
  # 4 KiB fits one process's capacity, not the other's: b12x there, psum here.
  results = _settings(multiprocess, {"capacity_bytes": 1 << 20}, {"capacity_bytes": 1024})
  for r in results:
    assert r["error"] == "ChannelError" and "process 0 has capacity_bytes=1048576, process 1 has capacity_bytes=1024" \
        in r["message"], r


def test_a_group_spanning_hosts_takes_the_psum_path_on_every_process_with_the_reason(multiprocess):
  hosts = {0: {"B12X_JAX_HOST_ID": "node-a"}, 1: {"B12X_JAX_HOST_ID": "node-b"}}
  results = _settings(multiprocess, {}, {}, env=hosts)
  for r in results:  # each process checked its values against float64
    assert r["error"] is None and r["path"] == "psum", r
    assert re.search(r"spans hosts \(process 0 on 'node-a', process 1 on 'node-b'\)", r["reason"]), r
    assert r["mapped"] == [], r
  same_host = _settings(multiprocess, {}, {}, env={0: hosts[0], 1: hosts[0]})
  assert [r["path"] for r in same_host] == ["b12x", "b12x"], same_host


def test_a_group_across_hosts_that_fell_back_leaves_a_group_within_a_host_on_b12x_in_every_process(multiprocess):
  # The fallback's verdict belongs to the group across hosts: in processes 0 and 3 the tp group has the
  # same local ordinals as the dp group, and they took psum where processes 1 and 2 waited for them.
  hosts = {p: {"B12X_JAX_HOST_ID": "node-a" if p < 2 else "node-b"} for p in range(4)}
  for r in multiprocess("two_hosts", 4, env=hosts, hard_timeout=180):
    assert r["paths"] == {"dp": "psum", "tp": "b12x"}, r


def test_shared_memory_names_a_dead_process_of_the_same_pid_left_are_passed_over_and_kept(multiprocess):
  # They made the preparation fail (the channel took psum for the life of the process), and its cleanup then
  # unlinked a name it had not created.
  for r in multiprocess("stale_shm", 2):
    assert r == {"path": "b12x", "kept": True}, r


def test_a_group_spanning_hosts_under_policy_strict_raises_on_every_process(multiprocess):
  hosts = {0: {"B12X_JAX_HOST_ID": "node-a"}, 1: {"B12X_JAX_HOST_ID": "node-b"}}
  for r in _settings(multiprocess, {"policy": "strict"}, {"policy": "strict"}, env=hosts):
    assert r["error"] == "TransportError", r
    assert re.search(r"spans hosts \(process 0 on 'node-a', process 1 on 'node-b'\).*\(policy 'strict'; "
                     r"policy='auto' falls back to psum\)", r["message"]), r


def test_one_process_of_three_that_disagrees_makes_all_three_raise(multiprocess):
  for r in _settings(multiprocess, {}, {}, {"algorithm": "two_shot"}):
    assert r["error"] == "ChannelError", r
    assert re.search(r"process [01] has algorithm='auto', process 2 has algorithm='two_shot'", r["message"]), r


def test_processes_of_different_builds_all_raise_naming_both_builds(multiprocess):
  # Before the build travelled in the frame, two builds that lay out or
  # read the channel's memory differently met on it without an error.
  other = "b12x_jax 0.0.9, protocol 0123456789abcdef"
  for r in _settings(multiprocess, {}, {}, env={1: {"B12X_TEST_BUILD": other}}):
    assert r["error"] == "ChannelError", r
    assert re.search(rf"process 0 runs {re.escape(rendezvous.build_id())}, process 1 runs {other}; install the "
                     rf"same b12x_jax build in every process", r["message"]), r
    assert r["seconds"] < 30 and r["mapped"] == [], r


def test_an_axis_across_processes_of_uneven_devices_agrees_and_runs_on_b12x(multiprocess):
  # Process 0 holds 2 devices, the axis 2: process 0 took the axis for one
  # of its own and skipped the agreement its peer waited in until timeout.
  results = multiprocess("uneven", 2, env={0: {"B12X_TEST_LOCAL_DEVICES": "2"}}, hard_timeout=60)
  assert [r["error"] for r in results] == [None, None], results
  assert [r["path"] for r in results] == ["b12x", "b12x"], results


@pytest.mark.parametrize("policies", [(None, None), (None, "psum")])
def test_an_axis_across_processes_no_longer_than_their_devices_agrees(multiprocess, policies):
  # 2 processes of 2 devices, the axis pairs one of each: no process
  # agreed, so one on the psum path met the other's b12x call (Gloo hung).
  env = {p: {"B12X_TEST_LOCAL_DEVICES": "2", **({"B12X_JAX_POLICY": policy} if policy else {})}
         for p, policy in enumerate(policies)}
  results = multiprocess("crossed", 2, "--communicators", json.dumps([{"setup_timeout_s": 5.0}] * 2), env=env,
                         hard_timeout=60)
  if policies[1] is None:
    assert [(r["error"], r["path"]) for r in results] == [(None, "b12x")] * 2, results
  else:
    for r in results:
      assert r["error"] == "ChannelError" and "process 0 has policy='auto', process 1 has policy='psum'" in \
          r["message"], r


def test_a_program_on_some_processes_only_times_out_naming_an_idle_one(multiprocess):
  # The limit README states: the agreement at trace time waits for every
  # process of jax.distributed, so processes 0 and 1 wait for idle 2.
  every = {"B12X_TEST_MESH_PROCESSES": "2"}
  results = multiprocess("uneven", 3, "--communicator", json.dumps({"setup_timeout_s": 2.0}),
                         env={p: every for p in range(3)}, hard_timeout=60)
  assert results[2] == {"idle": True}, results
  for r in results[:2]:
    assert r["error"] == "CollectiveTimeoutError", r
    assert re.search(r"timed out after 2 s in process [01]: process 2 did not report \(the last b12x_jax step "
                     r"it entered: none yet\)\. Tracing a call whose axis "
                     r"may span processes is collective.*every process must trace the same program", r["message"]), r


def test_a_frame_survives_encoding_and_a_frame_of_another_version_is_refused():
  settings = rendezvous.Settings("two_shot", "strict", 1 << 20, 4096, 16, 2.5, True, "auto")
  frame = rendezvous.Frame("cuda", "target", 1, 4, 3, "node-a (boot)", rendezvous.build_id(), settings,
                           (4096, 1024, 16), b"\x00handle")
  assert rendezvous.Frame.decode(frame.encode()) == frame
  older = bytearray(frame.encode())
  older[4:6] = (rendezvous.FRAME_VERSION - 1).to_bytes(2, "little")
  with pytest.raises(b12x_jax.ChannelError, match=rf"frame version {rendezvous.FRAME_VERSION - 1}, this process "
                                                  rf"{rendezvous.FRAME_VERSION}"):
    rendezvous.Frame.decode(bytes(older))
  with pytest.raises(b12x_jax.ChannelError, match="truncated or malformed"):
    rendezvous.Frame.decode(frame.encode()[:-1])


def check_never_calls(results: list[dict], timeout: str, platform: str) -> None:
  """The callers of never_calls mode: both calls raised the timeout error
  naming the channel, the caller's rank and the epoch, and the rank that
  never came (or, on a caller that stopped because another gave up, that
  one) within a bounded time. On CPU the calls raise; on CUDA the
  timed-out kernel's output comes back, all NaN, before check_errors
  raises."""
  *callers, absent = results
  victim = len(results) - 1
  assert absent["called"] is False
  for rank, r in enumerate(callers):
    assert len(r["messages"]) == 2, r
    assert r["nan_outputs"] == [] if platform == "cpu" else r["nan_outputs"] and all(r["nan_outputs"]), r
    for message in r["messages"]:
      assert re.search(rf"channel 'lonely' rank {rank} (timed out after {timeout} s at epoch \d+ waiting for rank "
                       rf"{victim}|stopped at epoch \d+: rank \d+ gave up)", message), r
    assert r["seconds"] < 2 * float(timeout) + 10, r
  assert any(f"waiting for rank {victim}" in r["messages"][0] for r in callers), callers


# What the mismatch mode's calls are (helpers.mismatch_program), by --op: call(n, protocol) gives the
# regexes of (the others' call, the odd one out's) in the tag error, on the protocol they take:
# "lamport" within the Lamport window, else the algorithm (dcp_a2a's barrier does not name it).
_DCP_CALL = r"dcp_a2a of {bytes} bytes \(bfloat16, {heads} heads of 512 bytes, lse base {base}, {protocol}grid \d+\)"
_FUSED_CALL = r"all_reduce_residual_rmsnorm of {bytes} bytes \({dtype}, rows of {bytes} bytes, grid \d+\)"
_SUM_CALL = r"all_reduce of {bytes} bytes \({dtype}, {protocol}, grid \d+\)"


def _dcp(n: int, protocol: str, heads: tuple, bases: tuple) -> list[str]:
  named = "lamport, " if protocol == "lamport" else ""
  return [_DCP_CALL.format(bytes=8192 * n, heads=h * n, base=b, protocol=named) for h, b in zip(heads, bases)]


def _sums(protocol: str, sizes: tuple, dtypes: tuple = ("float32", "float32")) -> list[str]:
  return [_SUM_CALL.format(bytes=b, dtype=t, protocol=protocol) for b, t in zip(sizes, dtypes)]


def _fused(protocol: str, sizes: tuple, dtypes: tuple, unfused_sizes: tuple) -> list[str]:
  """Within the window the fused call; else its unfused path's all_reduce of x in float32."""
  if protocol == "lamport":
    return [_FUSED_CALL.format(bytes=b, dtype=t) for b, t in zip(sizes, dtypes)]
  return _sums(protocol, unfused_sizes)


MISMATCHED_CALLS = {
    "dcp_a2a": lambda n, protocol: _dcp(n, protocol, (16, 8), ("e", "e")),
    "residual_rmsnorm": lambda n, protocol: _fused(protocol, (32768, 16384), ("float32",) * 2, (32768, 16384)),
    "all_reduce": lambda n, protocol: _sums(protocol, (256, 512)),
    "all_reduce_site": lambda n, protocol: _sums(protocol, (256, 256)),
    "all_reduce_dtype": lambda n, protocol: _sums(protocol, (64, 64), ("bfloat16", "float32")),
    "residual_rmsnorm_dtype": lambda n, protocol: _fused(protocol, (4096, 4096), ("bfloat16", "float32"),
                                                         (8192, 4096)),  # a bfloat16 row sums as twice its bytes
    "dcp_a2a_lse_base": lambda n, protocol: _dcp(n, protocol, (16, 16), ("e", "2")),
}
# The mismatches on the barrier protocols (lamport_bytes=0), as (op, algorithm): the all_reduce ones
# under every algorithm; dcp_a2a's barrier and the fused op's unfused path, whose all_reduce is the
# same protocol under each, under one.
BARRIER_MISMATCHES = [(op, algorithm) for op in ("all_reduce", "all_reduce_dtype", "all_reduce_site")
                      for algorithm in ("one_shot", "two_shot", "one_shot_pull")] + [
                          (op, "one_shot") for op in ("dcp_a2a", "dcp_a2a_lse_base", "residual_rmsnorm",
                                                      "residual_rmsnorm_dtype")]


def check_mismatch(results: list[dict], op: str, protocol: str = "lamport") -> None:
  """mismatch mode: every process stopped with an error and no number, in a
  bounded time, naming a peer at the other call and both calls (on
  ``protocol``): those at the others' call the odd one out (the last), the
  odd one a peer (rank 0 of two). A rank that waits for packs its peer
  never sends reports the mismatch too, not a timeout. Calls that differ in
  their site only name two sites."""
  n = len(results)
  ours, odd = MISMATCHED_CALLS[op](n, protocol)
  for rank, r in enumerate(results):
    assert r["messages"] and not r["finite"] and r["seconds"] < 30, r
    if rank < n - 1:
      wanted = tag_error(rank, ours, n - 1, odd)
    else:
      wanted = tag_error(rank, odd, 0 if n == 2 else r"\d+", ours)
    found = [m for m in r["messages"] if re.search(wanted, m)]
    assert found, "\n".join([wanted, *r["messages"]])
    assert len(set(re.findall(r"at site (0x[0-9a-f]{8})", found[0]))) == 2 or op != "all_reduce_site", found[0]


@pytest.mark.parametrize("op", sorted(MISMATCHED_CALLS))
def test_processes_at_different_calls_on_one_channel_stop_with_the_tag_error(multiprocess, op):
  check_mismatch(multiprocess("mismatch", 2, "--timeout", "5", "--op", op), op)


@pytest.mark.parametrize("op, algorithm", BARRIER_MISMATCHES)
def test_processes_at_different_calls_on_the_barrier_protocols_stop_with_the_tag_error(multiprocess, op, algorithm):
  results = multiprocess("mismatch", 2, "--timeout", "5", "--op", op,
                         "--communicator", json.dumps({"lamport_bytes": 0, "algorithm": algorithm}))
  check_mismatch(results, op, algorithm)


MISPLACED = (r"rank \d+ runs dcp_a2a of \d+ bytes \(bfloat16, [^)]*\) at site 0x[0-9a-f]{8}.* on another device "
             r"assignment than its module was lowered for")


def check_misplaced(results: list[dict]) -> None:
  """Every process of misplaced_export_mode stopped with the placement
  error, within its bound, and returned no number."""
  for r in results:
    assert r["messages"] and not r["finite"] and r["seconds"] < 30, r
    assert any(re.search(MISPLACED, m) for m in r["messages"]), r["messages"]


@pytest.mark.parametrize("n", [2, 4])
def test_an_export_called_with_its_devices_in_other_positions_stops_every_process(multiprocess, n):
  pytest.importorskip("flatbuffers", reason="jax.export needs the flatbuffers package")
  check_misplaced(multiprocess("misplaced_export", n, "--timeout", "5", hard_timeout=240))


def test_a_compiled_executable_after_release_and_prepare_takes_the_new_preparation_on_the_host(multiprocess):
  # The host backend runs every call's handler, so it reads the new view; the
  # rig's twin checks a CUDA graph replay, which must stop with the stale error.
  for r in multiprocess("stale_replay", 2):
    assert all(got == {"right": True, "messages": []} for got in r.values()), r


@pytest.mark.parametrize("op", INDEPENDENT_OPS)
@pytest.mark.parametrize("n", [2, 4])
def test_independent_calls_on_one_channel_run_in_program_order_across_processes(multiprocess, n, op):
  for r in multiprocess("independent", n, "--op", op, hard_timeout=240):
    assert r == {"wrong": 0, "results": 20 * 32, "taken": expected_taken(op, "lamport")}, r


@pytest.mark.parametrize("n", [2, 4])
def test_calls_of_back_to_back_executables_and_of_consecutive_shard_maps_run_in_one_order(multiprocess, n):
  # No token crosses executables or shard_maps (docs/DESIGN.md, "Call order"):
  # the device's queue and the module's chain keep them, with equal tags.
  for r in multiprocess("dispatch_order", n, hard_timeout=240):
    assert r == {"wrong": 0, "results": 10 * 12}, r


def test_a_process_that_reaches_its_first_call_15_s_late_is_waited_for(multiprocess):
  results = multiprocess("late_start", 2, "--timeout", "2", "--setup-timeout", "40", "--late", "15",
                         hard_timeout=180)
  assert results[0]["hashes"] == results[1]["hashes"], results
  assert results[0]["seconds"] > 10, results  # process 0 really waited on its first call


def check_drop_in(results: list[dict], rig: bool = False) -> None:
  """drop_in mode: every case took its path, was checked against float64 in
  every process (the psum cases on CPU only), and the ranks hold identical
  bits of every invariant result."""
  from mp_workers import DROP_IN_PATHS
  assert [r["rank"] for r in results] == list(range(len(results))), results
  psum_cases = {c for c, p in DROP_IN_PATHS.items() if p == "psum"}
  for r in results:
    assert r["paths"] == DROP_IN_PATHS, r
    assert set(r["checked"]) == set(DROP_IN_PATHS) - (psum_cases if rig else set()), r
    assert r["hashes"] == results[0]["hashes"] and len(r["hashes"]) == (4 if rig else 5), (r, results[0])


@pytest.mark.parametrize("n", [2, 4])
def test_the_drop_in_cases_across_processes_match_float64(multiprocess, n):
  check_drop_in(multiprocess("drop_in", n))


@pytest.mark.parametrize("n", [2, 4])
def test_every_process_lowers_one_program_with_every_devices_triton_addresses(multiprocess, n):
  results = multiprocess("same_program", n)
  assert len({r["program"] for r in results}) == 1, results
  for r in results:
    assert r["kernels"][:3] == ["triton", "triton", "ffi"] and r["tables"] == 2, r
    assert r["rows_filled"] == [[True] * n] * 2, r


def test_the_fused_op_is_right_across_the_counter_wrap_between_processes(multiprocess):
  from mp_workers import FUSED_CASES
  results = multiprocess("residual_rmsnorm", 2, "--wrap", "--communicator", json.dumps({"poison_outputs": True}))
  cases = 3 * len(FUSED_CASES)  # dtypes x shapes, run twice with --wrap
  assert results[0]["hashes"] == results[1]["hashes"] and len(results[0]["hashes"]) == cases, results
  assert {r["epoch"] for r in results} == {(2 * (2**32 - 5) + 2 * cases) % 2**32}, results  # both counters wrapped


def check_loops(results: list[dict], kinds: list[str]) -> None:
  """loops mode's results: every process checked its sums and ran 8
  iterations of two calls on "target" and one on "draft", of ``kinds``."""
  for r in results:
    assert r["epochs"] == [16, 8] and r["kinds"] == kinds, r


@pytest.mark.parametrize("poison", [False, True])
def test_calls_inside_a_loop_on_two_channels_match_float64_across_processes(multiprocess, poison):
  results = multiprocess("loops", 2, "--communicator", json.dumps({"poison_outputs": poison}))
  check_loops(results, ["all_reduce ffi", "all_reduce_residual_rmsnorm ffi"])


@pytest.mark.skipif(not os.path.exists(rendezvous.EPHEMERAL_PORTS), reason=f"no {rendezvous.EPHEMERAL_PORTS}")
def test_the_coordinator_port_is_free_and_outside_the_ephemeral_range():
  # An ephemeral port can be taken by any outgoing connection between the pick and the coordinator's bind.
  with open(rendezvous.EPHEMERAL_PORTS) as f:
    start, end = map(int, f.read().split())
  ports = {rendezvous.coordinator_port() for _ in range(20)}
  assert all(10000 <= port < start or end < port < 65536 for port in ports), (ports, start, end)
  assert len(ports) > 1, ports  # picked at random: two launchers at once rarely collide
  for port in ports:
    with socket.socket() as s:
      s.bind(("", port))


def test_a_port_held_on_either_family_is_not_free():
  # The coordinator binds [::]: a port an IPv6-only socket holds, which an IPv4 bind does not see, is taken.
  for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
    try:
      held = socket.socket(family)
    except OSError:
      continue  # no IPv6 on this host
    with held:
      if family == socket.AF_INET6:
        held.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
      held.bind((host, 0))
      port = held.getsockname()[1]
      assert not rendezvous.port_is_free(port), (family, port)


def test_the_multiprocess_benchmark_runs_each_collective_as_often_in_every_process():
  # Its warm-up filled a time, counted in each process alone: one process ran a collective more often than its
  # peer, which then waited for it (b12x's timeout, gloo's deadline) and the benchmark failed. The launcher waits
  # for each worker up to --timeout in turn: both within this test's bound, so it never leaves a worker behind.
  script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "all_reduce_multiprocess.py")
  proc = subprocess.run([sys.executable, script, "--processes", "2", "--platform", "cpu", "--sizes", "4096,65536",
                         "--ops", "4", "--iters", "3", "--timeout", "120"], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  rows = re.findall(r"^\| (4|64) KiB \| ([0-9.]+) \| ([0-9.]+) \|", proc.stdout, flags=re.M)
  assert [size for size, _, _ in rows] == ["4", "64"] and all(float(t) > 0 for _, *ts in rows for t in ts), proc.stdout
