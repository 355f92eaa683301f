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


MP_WORKERS = os.path.join(os.path.dirname(__file__), "mp_workers.py")


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture
def multiprocess():
  """Runs one tests/mp_workers.py MODE per process, ``n`` processes joined by
  ``jax.distributed`` on 127.0.0.1, one device each; kills every one still
  running after ``hard_timeout`` seconds, and returns their RESULTs in
  process order (asserting each exited 0 with one; the processes in
  ``killed`` must have died of SIGKILL instead, and give None). ``env``
  adds variables to the environment of single processes: {process: {name:
  value}}."""
  def run(mode: str, n: int = 2, *args: str, platform: str = "cpu", hard_timeout: float = 120.0,
          killed: tuple[int, ...] = (), env: dict[int, dict[str, str]] | None = None) -> list[dict | None]:
    port = str(_free_port())
    common = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # not this process's 4 emulated devices
    procs = [subprocess.Popen([sys.executable, MP_WORKERS, mode, "--process-id", str(i), "--num-processes", str(n),
                               "--port", port, "--platform", platform, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**common, **(env or {}).get(i, {})})
             for i in range(n)]
    outputs, timed_out = [], False
    for proc in procs:
      try:
        outputs.append(proc.communicate(timeout=max(1.0, hard_timeout)))
      except subprocess.TimeoutExpired:
        timed_out = True
        for p in procs:
          p.kill()
        outputs.append(proc.communicate())
    for p in procs[len(outputs):]:
      outputs.append(p.communicate())
    results = []
    for i, (proc, (out, err)) in enumerate(zip(procs, outputs)):
      if i in killed:  # the mode kills this process on purpose
        assert not timed_out and proc.returncode == -9, f"process {i} of {mode}: rc={proc.returncode}\n{err[-3000:]}"
        results.append(None)
        continue
      lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
      assert not timed_out and proc.returncode == 0 and lines, \
          f"process {i} of {mode}: rc={proc.returncode} timed_out={timed_out}\n{err[-3000:]}"
      results.append(json.loads(lines[0][len("RESULT "):]))
    return results
  return run


@pytest.fixture(autouse=True)
def no_stored_calibration(tmp_path_factory, monkeypatch):
  """Tests see the packaged crossover table only, never a calibration
  stored on this machine (tests of tuning.py point it elsewhere)."""
  monkeypatch.setenv("B12X_JAX_CACHE", str(tmp_path_factory.mktemp("b12x_cache")))


@pytest.fixture
def cpu_mesh():
  """A factory of 1-D meshes of n emulated CPU devices on axis 'x'."""
  def make(n: int):
    return jax.make_mesh((n,), ("x",), devices=jax.devices("cpu")[:n])
  return make
