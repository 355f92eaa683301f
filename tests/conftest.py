"""Test configuration: CPU tests see 4 emulated host devices; GPU tests are
marked ``gpu`` and skip, with the reason, below 2 GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

WORKERS = os.path.join(os.path.dirname(__file__), "workers.py")


def gpu_count() -> int:
  try:
    return len(jax.devices("gpu"))
  except RuntimeError:
    return 0


requires_2_gpus = pytest.mark.skipif(gpu_count() < 2, reason=f"needs 2 GPUs in this process, found {gpu_count()}")


def run_worker(*args: str, hard_timeout: float = 120.0) -> dict:
  """Runs tests/workers.py in a subprocess killed after ``hard_timeout``
  seconds (hang-prone tests never hang the suite) and returns its RESULT."""
  proc = subprocess.run([sys.executable, WORKERS, *args], capture_output=True, text=True, timeout=hard_timeout)
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      assert proc.returncode == 0, proc.stderr[-3000:]
      return json.loads(line[len("RESULT "):])
  raise AssertionError(f"worker {args} exited {proc.returncode} without a result:\n{proc.stderr[-3000:]}")


@pytest.fixture
def cpu_mesh():
  """A factory of 1-D meshes of n emulated CPU devices on axis 'x'."""
  def make(n: int):
    return jax.make_mesh((n,), ("x",), devices=jax.devices("cpu")[:n])
  return make
