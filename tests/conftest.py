"""Test configuration: CPU tests see 4 emulated host devices; GPU tests are
marked ``gpu`` and skip, with the reason, below 2 GPUs; tests on the
one-GPU rig (several processes on GPU 0, fixture ``gpu_rig``) are marked
``gpu_rig`` and skip without a GPU, a CUDA build or MPS."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from b12x_jax.rendezvous import coordinator_port  # noqa: E402

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


def _stderr_digest(err: str) -> str:
  """What a failed worker said: its fatal lines (an XLA check failure comes
  before a long stack trace) and the end of its stderr."""
  fatal = [ln for ln in err.splitlines() if re.match(r"(F\d{4} |.*Check failed|.*Error:)", ln)][:10]
  return "\n".join(fatal) + "\n...\n" + err[-2500:]


@pytest.fixture
def multiprocess():
  """Runs one tests/mp_workers.py MODE per process, ``n`` processes joined by
  ``jax.distributed`` on 127.0.0.1, one device each; kills every one still
  running after ``hard_timeout`` seconds, and returns their RESULTs in
  process order (asserting each exited 0 with one; the processes in
  ``killed`` must have died of SIGKILL instead, and give None). ``env``
  adds variables to the environment of single processes: {process: {name:
  value}}; ``launcher`` is a command every worker runs under (a sanitizer)."""
  def run(mode: str, n: int = 2, *args: str, platform: str = "cpu", hard_timeout: float = 120.0,
          killed: tuple[int, ...] = (), env: dict[int, dict[str, str]] | None = None,
          launcher: tuple[str, ...] = ()) -> list[dict | None]:
    port = str(coordinator_port())
    common = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # not this process's 4 emulated devices
    procs = [subprocess.Popen([*launcher, sys.executable, MP_WORKERS, mode, "--process-id", str(i), "--num-processes", str(n),
                               "--port", port, "--platform", platform, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**common, **(env or {}).get(i, {})})
             for i in range(n)]
    outputs, timed_out = [], False
    deadline = time.monotonic() + hard_timeout  # one bound for all of them
    try:
      for proc in procs:
        try:
          outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
          timed_out = True
          for p in procs:
            p.kill()
          outputs.append(proc.communicate())
    finally:  # an interrupted test leaves no worker behind
      for p in procs:
        if p.poll() is None:
          p.kill()
    for p in procs[len(outputs):]:
      outputs.append(p.communicate())
    results = []
    for i, (proc, (out, err)) in enumerate(zip(procs, outputs)):
      if i in killed:  # the mode kills this process on purpose
        assert not timed_out and proc.returncode == -9, f"process {i} of {mode}: rc={proc.returncode}\n{err[-3000:]}"
        results.append(None)
        continue
      lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
      if timed_out or proc.returncode != 0 or not lines:  # every failed process says why, not just the first
        failed = [f"process {j} of {mode}: rc={p.returncode}\n{_stderr_digest(e)}"
                  for j, (p, (_, e)) in enumerate(zip(procs, outputs)) if j not in killed and p.returncode != 0]
        raise AssertionError(f"timed_out={timed_out}\n" + "\n".join(failed or [f"process {i}: no RESULT"]))
      results.append(json.loads(lines[0][len("RESULT "):]))
    return results
  return run


# -- the one-GPU rig: N processes on GPU 0 -------------------------------------------------------------
MPS_CONTROL = "/usr/local/nvidia/bin/nvidia-cuda-mps-control"
# Where an MPS control daemon listens: the one the environment names, else the
# default one, else the rig's own (started by the ``mps`` fixture).
_MPS_PIPES = [os.environ["CUDA_MPS_PIPE_DIRECTORY"]] if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else \
    ["/tmp/nvidia-mps", "/tmp/b12x_mps/pipe"]
_MPS_LOG = os.environ.get("CUDA_MPS_LOG_DIRECTORY") or "/tmp/b12x_mps/log"


def _mps_control() -> str | None:
  return MPS_CONTROL if os.access(MPS_CONTROL, os.X_OK) else shutil.which("nvidia-cuda-mps-control")


def _rig_unavailable() -> str | None:
  """Why the one-GPU rig cannot run here, or None. Asks nvidia-smi, not
  jax: the test process itself need not hold a CUDA context (gpu_check.sh
  runs it with JAX_PLATFORMS=cpu)."""
  from b12x_jax import _b12x
  if not _b12x.has_cuda():
    return "the gpu_rig needs a b12x_jax build with CUDA (this one was built without: B12X_CUDA=OFF or no toolkit)"
  smi = shutil.which("nvidia-smi")
  listed = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout if smi else ""
  if "GPU 0" not in listed:
    return "the gpu_rig needs a GPU and none is visible (nvidia-smi -L lists no GPU 0)"
  if _mps_control() is None:
    return (f"the gpu_rig needs CUDA MPS so that the processes' kernels run at once on GPU 0 (without it a call "
            f"costs milliseconds of context switching), and neither {MPS_CONTROL} nor nvidia-cuda-mps-control "
            f"on PATH exists")
  return None


def _mps_answers(control: str, pipe: str) -> bool:
  """Whether an MPS control daemon listens on ``pipe``."""
  if not os.path.exists(os.path.join(pipe, "control")):
    return False
  answer = subprocess.run([control], input="get_server_list\n", capture_output=True, text=True, timeout=10,
                          env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe})
  return answer.returncode == 0 and "Cannot find" not in answer.stdout + answer.stderr


@pytest.fixture(scope="session")
def mps():
  """The MPS environment of processes sharing GPU 0 ({variable: value}):
  uses a control daemon that already answers, else starts one (pipe and
  log directories under /tmp) and stops it when the session ends. Skips,
  with the reason, where the rig cannot run."""
  reason = _rig_unavailable()
  if reason:
    pytest.skip(reason)
  control = _mps_control()
  running = next((pipe for pipe in _MPS_PIPES if _mps_answers(control, pipe)), None)
  pipe = running or _MPS_PIPES[-1]
  env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": _MPS_LOG}
  if running is None:
    for directory in env.values():
      os.makedirs(directory, exist_ok=True)
    subprocess.run([control, "-d"], env={**os.environ, **env, "CUDA_VISIBLE_DEVICES": "0"}, check=True, timeout=30)
    deadline = time.monotonic() + 10
    while not _mps_answers(control, pipe):
      assert time.monotonic() < deadline, f"the MPS control daemon started in {pipe} does not answer"
      time.sleep(0.2)
  yield env
  if running is None:
    subprocess.run([control], input="quit\n", text=True, timeout=30, env={**os.environ, **env})


@pytest.fixture
def gpu_rig(multiprocess, mps):
  """Runs one tests/mp_workers.py MODE in ``n`` processes that all take GPU 0
  (CUDA_VISIBLE_DEVICES=0, local_device_ids=[0]): a mesh of ``n`` distinct
  devices on one GPU, b12x between them over CUDA IPC, their kernels
  running at once under MPS. Every process's Communicator gets
  ``communicator`` and max_blocks=64 // n: the blocks of all the processes'
  kernels wait on each other, so together they must be resident at once
  (DESIGN C10) on one GPU's SMs. Returns the RESULTs as ``multiprocess``
  does; ``env`` adds variables to every process's environment."""
  def run(mode: str, n: int, *args: str, communicator: dict | None = None, env: dict[str, str] | None = None,
          hard_timeout: float = 150.0, launcher: tuple[str, ...] = ()) -> list[dict]:
    options = {"max_blocks": 64 // n, **(communicator or {})}
    every = {"CUDA_VISIBLE_DEVICES": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **mps, **(env or {})}
    return multiprocess(mode, n, *args, "--communicator", json.dumps(options), platform="gpu_rig",
                        hard_timeout=hard_timeout, env={i: every for i in range(n)}, launcher=launcher)
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
