"""One process per GPU over CUDA IPC (jax.distributed, 2 processes, one GPU
each): the CPU multi-process cases (tests/test_multiprocess.py) on GPUs. Kept out of
tests/gpu so the one-process GPU run does not repeat it.
Marked gpu; skipped below 2 GPUs."""

from __future__ import annotations

import json
import re

import pytest

from conftest import requires_2_gpus
from test_multiprocess import check_dcp, dcp_options

pytestmark = [pytest.mark.gpu, requires_2_gpus]


def test_all_reduce_across_gpu_processes_matches_float64_with_identical_bits(multiprocess):
  results = multiprocess("all_reduce", 2, "--configs", json.dumps([{"poison_outputs": True}]), platform="gpu",
                         hard_timeout=300)
  assert [r["rank"] for r in results] == [0, 1] and results[0]["hashes"] == results[1]["hashes"]
  assert [r["epochs"] for r in results] == [[8], [8]]


def test_dcp_a2a_across_gpu_processes_matches_full_attention(multiprocess):
  results = multiprocess("dcp", 2, "--communicator", dcp_options("lamport"), platform="gpu", hard_timeout=300)
  check_dcp(results, wrap=False, protocol="lamport")


def test_channels_requested_in_different_orders_pair_by_name_on_gpus(multiprocess):
  results = multiprocess("order", platform="gpu", hard_timeout=300)
  assert results[0]["hashes"] == results[1]["hashes"]


def test_a_failed_preparation_on_one_gpu_process_makes_all_raise(multiprocess):
  results = multiprocess("failed_prepare", platform="gpu", hard_timeout=300)
  for r in results:
    assert re.search(r"step 'opened' failed on 1 of 2 processes", r["errors"]["opened"]), r
  assert results[0]["hash"] == results[1]["hash"]


def test_throwaway_channel_and_close_on_gpus(multiprocess):
  results = multiprocess("throwaway", platform="gpu", hard_timeout=300)
  assert all(r["after_failure"] == [] and r["epoch"] == 1 for r in results) and results[0]["hash"] == results[1]["hash"]
  for r in multiprocess("close_twice", platform="gpu", hard_timeout=300):
    assert r["closed"] and r["prepared"] == []


def test_exit_with_pending_work_on_gpus(multiprocess):
  assert multiprocess("exit_pending", platform="gpu", hard_timeout=300) == [{"dispatched": True}] * 2


def test_a_gpu_peer_killed_mid_run_makes_the_survivor_raise_within_the_timeout(multiprocess):
  survivor, killed = multiprocess("killed_peer", 2, "--timeout", "2", platform="gpu", hard_timeout=300, killed=(1,))
  assert killed is None and survivor["done"] == 3 and survivor["wrong"] == 0, survivor
  assert re.search(r"channel 'mortal' rank 0 timed out after 2 s at epoch 4 waiting for rank 1",
                   survivor["message"]), survivor
  assert survivor["seconds"] < 2 + 5, survivor


def test_the_drop_in_cases_across_gpu_processes_match_float64(multiprocess):
  from test_multiprocess import check_drop_in
  check_drop_in(multiprocess("drop_in", 2, platform="gpu", hard_timeout=300))  # psum over NCCL runs here
