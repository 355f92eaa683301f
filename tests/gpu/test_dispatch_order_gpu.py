"""tests/test_dispatch_order.py on 2 GPUs of one process (marked gpu; skipped below 2)."""

from __future__ import annotations

import pytest

from conftest import requires_2_gpus
from test_dispatch_order import check_crossed, check_race

pytestmark = [pytest.mark.gpu, requires_2_gpus]


def test_gpu_channels_queued_in_opposite_orders_give_the_timeout_error_naming_both():
  text = check_crossed("gpu", timeout=2.0)
  # Each rank's second call stopped at once because its peer had given up, not after a timeout of its own.
  assert "gave up on the channel" in text, text


def test_two_threads_dispatching_target_and_draft_on_gpus_give_right_results_or_the_error():
  result = check_race("gpu", runs=500, timeout=3.0)
  print(f"RACE platform=gpu right={result['right']} nan={result['nan']} errors={len(result['errors'])}")
