"""One process per device with jax.distributed, on the CPU backend (POSIX
shared memory between processes): the same preparation, rendezvous and
teardown code as CUDA IPC on GPUs (DESIGN §3, C4, C11). Each test runs 2
worker processes (tests/mp_workers.py) with a hard timeout."""

from __future__ import annotations

import re


def test_all_reduce_across_processes_matches_float64_with_identical_bits(multiprocess):
  results = multiprocess("all_reduce")
  assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {2}
  assert results[0]["hashes"] == results[1]["hashes"]  # each process checked its values against float64
  assert {r["epoch"] for r in results} == {8}


def test_counters_wrap_across_processes_with_the_same_results(multiprocess):
  results = multiprocess("wrap")
  assert results[0]["hashes"] == results[1]["hashes"]  # each process checked its values against float64
  # Barrier and Lamport counters both started at 2**32 - 5 and ran 12 calls each.
  assert {r["epoch"] for r in results} == {(2 * (2**32 - 5) + 24) % 2**32}


def test_dcp_a2a_across_processes_matches_full_attention(multiprocess):
  results = multiprocess("dcp")
  assert [r["rank"] for r in results] == [0, 1] and {r["epoch"] for r in results} == {2}


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


def test_a_process_that_never_joins_gives_the_others_the_timeout_error(multiprocess):
  waiting, _ = multiprocess("never_joins", 2, "--setup-timeout", "2")
  assert re.search(r"prepare/cpu/alone/.*step 'allocated' timed out after 2 s in process 0: process 1 did not "
                   r"report.*every process of the group must make the same calls", waiting["message"]), waiting
  assert waiting["seconds"] < 10 and waiting["mapped"] == []


def test_close_twice_is_harmless_and_unmaps_everything(multiprocess):
  for r in multiprocess("close_twice"):
    assert r == {"closed": True, "prepared": [], "mapped": []}


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
