"""Counters across the uint32 wrap on the CPU backend (docs/DESIGN.md,
"Wrap"; DESIGN C14): a channel started just below 2**32 runs every path,
interleaved on one channel, each algorithm above the Lamport window, and
every result matches float64 (tests/wrap.py)."""

from __future__ import annotations

import pytest

from helpers import fresh_communicator
from wrap import START, communicator_options, expected_epoch, run_across_wrap

CALLS = 12


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot", "one_shot_pull"])
def test_every_path_is_right_across_the_counter_wrap(cpu_mesh, n, algorithm):
  with fresh_communicator(**communicator_options(algorithm)) as comm:
    result = run_across_wrap(comm, cpu_mesh(n), f"wrap{n}", CALLS, seed=n)
  assert result["paths"] == ["b12x"] and result["dcp_protocols"] == ["lamport", "barrier"], result
  assert result["epoch"] == expected_epoch(algorithm, CALLS), result  # the hook took, and the counters wrapped
  assert result["epoch"] < START  # mod 2**32: past the wrap


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_epoch_zero_right_after_the_wrap_waits_for_its_peers(cpu_mesh, algorithm):
  # From 2**32 - 1 the first barrier is epoch 0: its parity-0 flag must not read as an arrival; the hook
  # leaves 2**32 - 2 there, as a real run would (docs/DESIGN.md, "Wrap"), and a flag left at 0 would be
  # caught by the call tag (a tag nobody wrote never matches).
  with fresh_communicator(**communicator_options(algorithm)) as comm:
    result = run_across_wrap(comm, cpu_mesh(2), "wrap-zero", 4, seed=3, start=2**32 - 1)
  assert result["epoch"] == expected_epoch(algorithm, 4, start=2**32 - 1), result


def test_start_counters_needs_a_prepared_channel():
  import b12x_jax
  from b12x_jax import _native
  with pytest.raises(b12x_jax.ChannelError, match=r"channel 'never-prepared' is not prepared"):
    _native.start_counters("cpu", "never-prepared", START)
