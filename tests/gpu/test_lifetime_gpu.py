"""Channel memory across release and prepare on 2 CUDA GPUs of one process
(marked gpu; skipped below 2): the CPU test's program
(tests/test_lifetime.py) on a CUDA group, whose memory is reset on the
device when prepared again (cuda_channel.cu CudaGroup::reset), on the Lamport
and on the barrier path. The one-GPU rig runs the same across processes."""

from __future__ import annotations

import jax
import pytest

from conftest import requires_2_gpus
from test_lifetime import check_compiled_across_release_and_prepare

pytestmark = [pytest.mark.gpu, requires_2_gpus]


@pytest.mark.parametrize("elems", [1024, 1 << 19])  # 4 KiB: Lamport; 2 MiB: the barrier path
def test_a_compiled_executable_is_right_across_release_and_prepare_on_gpus(elems):
  check_compiled_across_release_and_prepare(jax.make_mesh((2,), ("x",), devices=jax.devices("gpu")[:2]), elems)
