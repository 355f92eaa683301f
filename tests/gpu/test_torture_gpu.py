"""Torture on 2 CUDA GPUs of one process (marked gpu; skipped below 2):
random programs of all_reduce and dcp_a2a calls on channels "target" and
"draft", interleaved, every result checked against float64 NumPy
(tests/torture.py), with CUDA graphs (XLA command buffers) on and off.

Runs in a worker subprocess (its own XLA flags) with ``poison_outputs``:
every output is NaN before the kernel writes it, so an element a kernel
misses fails its check. ``B12X_TORTURE_CALLS`` sets the collective calls
checked per graphs setting (default 4000), ``B12X_TORTURE_SEED`` the seed;
``-s`` shows one summary line each."""

from __future__ import annotations

import os

import pytest

from conftest import requires_2_gpus, run_worker

pytestmark = [pytest.mark.gpu, requires_2_gpus]
N = 2
CALLS = int(os.environ.get("B12X_TORTURE_CALLS", "4000"))
SEED = int(os.environ.get("B12X_TORTURE_SEED", "0"))


@pytest.mark.parametrize("graphs", ["on", "off"])
def test_random_programs_on_target_and_draft_give_float64_results_with_cuda_graphs_on_and_off(graphs):
  flags = "" if graphs == "on" else "--xla_gpu_enable_command_buffer="
  result = run_worker("torture", "--platform", "gpu", "--devices", str(N), "--calls", str(CALLS), "--seed", str(SEED),
                      "--programs", "16", f"--xla-flags={flags}", hard_timeout=900)
  print(f"TORTURE platform=gpu calls={result['calls']} runs={result['runs']} graphs={graphs} "
        f"programs={result['programs']} ops={result['ops']} paths={result['paths']}")
  assert result["calls"] >= CALLS
  assert result["paths"].get("b12x", 0) > 0 and result["paths"].get("psum", 0) > 0, result
