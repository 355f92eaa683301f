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


def run_example(name: str, *args: str, devices: int = 2, timeout: float = 240.0) -> subprocess.CompletedProcess:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
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
    ("dcp_decode.py", ("--heads", "5"), "--heads=5 and --kv-len=256 must be multiples of --devices=2"),
    ("dcp_decode.py", ("--processes", "2", "--devices", "4"), "--devices=4 must equal --processes=2"),
])
def test_examples_name_the_bad_argument(name, args, message):
  proc = run_example(name, *args, timeout=60.0)
  assert proc.returncode != 0
  assert message in proc.stderr, proc.stderr[-2000:]
