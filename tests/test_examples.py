"""The examples run small on CPU devices: each checks its own results (tokens
against greedy decoding on one device, attention against float64) and exits
non-zero when they are wrong; these tests read the exit status and the check
lines, and that the b12x calls ran on b12x rather than a fallback."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")


def run_example(name: str, *args: str, devices: int = 2, timeout: float = 240.0,
                xla_flags: str | None = None) -> subprocess.CompletedProcess:
  """``name`` on ``devices`` emulated CPU devices, or with ``xla_flags`` as XLA_FLAGS (the example adds its own)."""
  flags = f"--xla_force_host_platform_device_count={devices}" if xla_flags is None else xla_flags
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
  return subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], capture_output=True, text=True,
                        env=env, timeout=timeout)


def _plotted(out: str, path) -> bool:
  """--plot wrote its PNG, or said that it could not (matplotlib is no dependency)."""
  return os.path.getsize(path) > 0 if os.path.exists(path) else \
      f"--plot {path}: matplotlib is not importable; no plot written" in out


def test_speculative_decoding_tokens_equal_greedy_decoding_on_one_device(tmp_path):
  # float32: rounding cannot split greedy choices, so both variants must equal the reference exactly.
  png = tmp_path / "speculative.png"
  proc = run_example("speculative_decoding.py", "--batch", "2", "--k", "3", "--new-tokens", "20", "--repeats", "1",
                     "--plot", str(png), "--host-loop")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  out = proc.stdout
  # The device-resident loop and the loop of one jitted round per dispatch from Python, both checked.
  assert ("tokens equal plain greedy decoding of the target on one device (b12x, psum, b12x (round per dispatch), "
          "psum (round per dispatch); 2 x 20 new tokens)") in out, out
  assert out.rstrip().endswith("speculative decoding OK")
  # Every collective the model counts ran on a b12x channel, once.
  epochs = re.search(r"b12x channel epochs per generation: target (\d+), draft (\d+) "
                     r"\(the model's count: (\d+) and (\d+)\)", out)
  assert epochs, out
  assert epochs.group(1) == epochs.group(3) and epochs.group(2) == epochs.group(4), epochs.group(0)
  paths = re.search(r"paths taken by the b12x calls \(comm.decisions\): (.*)", out).group(1)
  assert paths == "all_reduce b12x, all_reduce_residual_rmsnorm b12x", paths
  for row in ("ms per token (latency)", "tokens/s", "ms per token, round per dispatch", "collectives share of a round",
              "acceptance"):
    assert row in out, row
  assert _plotted(out, png), out


def test_dcp_decode_matches_full_attention_in_float64_on_four_ranks(tmp_path):
  png = tmp_path / "dcp.png"
  proc = run_example("dcp_decode.py", "--devices", "4", "--batch", "3", "--heads", "8", "--head-dim", "64",
                     "--kv-len", "128", "--steps", "8", "--repeats", "2", "--plot", str(png), devices=4)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  out = proc.stdout
  assert "dcp_a2a path: b12x" in out, out
  for merge in ("b12x", "all_to_all"):
    assert re.search(rf"^{merge} +: +[\d.]+ us per decode step; relative error over 8 steps", out, re.M), out
  assert out.rstrip().endswith("dcp decode OK")
  assert _plotted(out, png), out


@pytest.mark.parametrize(("name", "args", "check"), [
    ("speculative_decoding.py", ("--layers", "2", "--new-tokens", "12", "--repeats", "1", "--host-loop"),
     "tokens equal plain greedy decoding of the target on one device (b12x, psum, b12x (round per dispatch), psum "
     "(round per dispatch); 1 x 12 new tokens)"),
    ("dcp_decode.py", ("--steps", "8", "--repeats", "1"), "relative error over 8 steps"),
])
def test_the_examples_run_as_two_processes_of_one_device_each(name, args, check):
  # What the one-GPU rig runs on GPU 0 (--shared-gpu): jax.distributed, one b12x rank per process.
  proc = run_example(name, "--processes", "2", *args, devices=1, timeout=400.0)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert "x cpu in 2 processes" in proc.stdout and check in proc.stdout, proc.stdout
  assert proc.stdout.rstrip().endswith("OK"), proc.stdout


@pytest.mark.parametrize(("name", "args", "message"), [
    ("speculative_decoding.py", ("--kv-heads", "3"), "--kv-heads=3 must be a multiple of --devices=2"),
    ("speculative_decoding.py", ("--draft-layers", "5"), "--draft-layers=5 must be between 1 and --layers=4"),
    ("dcp_decode.py", ("--heads", "5"), "--heads=5 must be a multiple of --devices=2"),
    ("dcp_decode.py", ("--devices", "3", "--heads", "12"), "--kv-len=256 must be a multiple of --devices=3"),
    ("dcp_decode.py", ("--processes", "2", "--devices", "4"), "--devices=4 must equal --processes=2"),
])
def test_examples_name_the_bad_argument(name, args, message):
  proc = run_example(name, *args, timeout=60.0)
  assert proc.returncode != 0
  assert message in proc.stderr, proc.stderr[-2000:]


SMALL = {"quickstart.py": (), "speculative_decoding.py": ("--layers", "2", "--new-tokens", "8", "--repeats", "1"),
         "dcp_decode.py": ("--steps", "2", "--repeats", "1")}
# Under B12X_JAX_POLICY=psum every b12x call takes its fallback: what each example says about it.
PSUM_LINES = {"quickstart.py": [r"channel target : max relative error \S+, path psum",
                                r"channel target : no b12x call \(policy 'psum' forces the psum path\)"],
              "speculative_decoding.py": [r"^ +psum\* +psum$", r"^\* b12x's b12x_jax calls took the psum path: "
                                                               r"policy 'psum' forces the psum path$"],
              "dcp_decode.py": [r"^all_to_all\* +: ", r"^\* b12x's b12x_jax calls took the all_to_all path"]}


def test_the_examples_keep_the_xla_flags_a_user_set_and_add_their_devices(tmp_path):
  # They left XLA_FLAGS as it was when set, so JAX found one CPU device and raised its mesh-size error.
  for name in SMALL:  # flags that dump no module
    proc = run_example(name, *SMALL[name], xla_flags=f"--xla_dump_to={tmp_path} --xla_dump_hlo_module_re=^none$")
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("OK"), proc.stderr[-2000:]


@pytest.mark.parametrize("policy", ["psum", "strict"])
@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_example_runs_under_the_operators_policy_and_labels_the_path_taken(name, policy):
  proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *SMALL[name]], capture_output=True, text=True,
                        timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu", "B12X_JAX_POLICY": policy,
                                          "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert proc.stdout.rstrip().endswith("OK"), proc.stdout
  for line in PSUM_LINES[name]:  # psum: every call took it; strict: none did
    assert bool(re.search(line, proc.stdout, re.M)) == (policy == "psum"), (line, proc.stdout)
  assert "None kernel" not in proc.stdout, proc.stdout


def test_the_quickstart_reports_each_channels_own_calls():
  # It printed the last decision of any channel (a cached executable's call records none: the draft's,
  # beside the second target call) and "1 calls".
  proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "quickstart.py")], capture_output=True, text=True,
                        timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu", "B12X_JAX_POLICY": "auto",
                                          "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  for line in (r"^channel target : 2 calls on rank 0$", r"^channel draft  : 1 call on rank 0$"):
    assert re.search(line, proc.stdout, re.M), (line, proc.stdout)
  assert len(re.findall(r"^channel \w+ +: max relative error \S+, path b12x$", proc.stdout, re.M)) == 3, proc.stdout


def test_two_processes_show_process_0s_output_once_without_the_runtime_noise():
  proc = run_example("dcp_decode.py", "--processes", "2", "--steps", "2", "--repeats", "1", devices=1, timeout=300.0)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  both = proc.stdout + proc.stderr
  for noise in ("[Gloo]", "WatchTasks", "GRPC", "Connection refused"):
    assert noise not in both, both
  assert proc.stdout.count("mesh: 2 x cpu in 2 processes") == 1, proc.stdout
  assert len(re.findall(r"\[1/\d+, [\d.]+ s\] b12x: compiled and run", proc.stderr)) == 1, proc.stderr
