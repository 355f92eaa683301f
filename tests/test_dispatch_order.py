"""Target and draft dispatched in different orders (issue: reliability).

The rule the library gives users: collectives of one channel run in one
order on every rank (dispatch one channel's executables from one thread);
two channels may be queued in different orders on different ranks, and
then the outcome is right results, or the timeout error naming both
channels with NaN outputs: never a wrong number, never a hang. These run
on the CPU backend; tests/gpu/test_dispatch_order_gpu.py runs them on GPUs.
"""

from __future__ import annotations

import pytest

from conftest import run_worker


def check_crossed(platform: str, timeout: float, late: float = 0.0) -> str:
  result = run_worker("cross", "--platform", platform, "--timeout", str(timeout), "--late", str(late),
                      hard_timeout=240)
  text = "\n".join(result["messages"])
  assert "channel 'target'" in text and "channel 'draft'" in text, result
  assert "did not arrive" in text, result
  assert not result["finite"], result  # a call that could not finish leaves NaN, never a number
  assert result["seconds"] < late + timeout + 5, result  # one timeout, not one per channel
  return text


def check_race(platform: str, runs: int, timeout: float) -> dict:
  result = run_worker("race", "--platform", platform, "--runs", str(runs), "--timeout", str(timeout),
                      hard_timeout=240)
  assert result["wrong"] == 0, result
  if result["nan"] or result["errors"]:  # the queues crossed: both channels must say so
    text = "\n".join(result["errors"])
    assert "channel 'target'" in text and "channel 'draft'" in text, result
  else:
    assert result["right"] == result["calls"], result
  return result


@pytest.mark.parametrize("late", [0.0, 0.5])
def test_channels_queued_in_opposite_orders_give_the_timeout_error_naming_both(late):
  # late: rank 1's own timeout ends after rank 0's error was raised, and
  # check_errors still reports it (it waits for the host calls in flight).
  check_crossed("cpu", timeout=1.0, late=late)


def test_two_threads_dispatching_target_and_draft_give_right_results_or_the_error():
  check_race("cpu", runs=100, timeout=2.0)
