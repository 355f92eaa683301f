"""The CUDA handlers refuse hand-built calls whose results or rows do not
fit their operands (marked gpu, skipped without a GPU): the CPU test's
cases (tests/test_bad_input.py) on a group of one GPU through loopback
(docs/DESIGN.md, "Loopback"), which runs the CUDA handlers' own checks."""

from __future__ import annotations

import jax
import pytest
from helpers import fresh_communicator
from test_bad_input import HAND_BUILT_CASES, check_a_hand_built_call_is_refused

from conftest import gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")]


@pytest.mark.parametrize("case", HAND_BUILT_CASES)
def test_a_hand_built_call_whose_shapes_disagree_is_refused_by_the_cuda_handler(case):
  with fresh_communicator(loopback=True):
    check_a_hand_built_call_is_refused(jax.make_mesh((1,), ("x",), devices=jax.devices("gpu")[:1]), case)
