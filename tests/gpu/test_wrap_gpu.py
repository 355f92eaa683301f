"""Counters across the uint32 wrap on 2 CUDA GPUs of one process (marked
gpu; skipped below 2): the CPU test's program (tests/wrap.py) on the CUDA
kernels, so the Lamport buffer cycle, the parity flags and both two-shot
epochs cross 2**32 on the device, every result against float64."""

from __future__ import annotations

import jax
import pytest

from conftest import requires_2_gpus
from helpers import fresh_communicator
from wrap import START, communicator_options, expected_epoch, run_across_wrap

pytestmark = [pytest.mark.gpu, requires_2_gpus]
CALLS = 12


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot", "one_shot_pull"])
def test_every_path_is_right_across_the_counter_wrap_on_gpus(algorithm):
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices("gpu")[:2])
  with fresh_communicator(**communicator_options(algorithm)) as comm:
    result = run_across_wrap(comm, mesh, "wrap-gpu", CALLS, seed=7)
  assert result["paths"] == ["b12x"] and result["dcp_protocols"] == ["lamport", "barrier"], result
  # CUDA's stats count block 0's barriers and Lamport calls, like the host's.
  assert result["epoch"] == expected_epoch(algorithm, CALLS) and result["epoch"] < START, result
