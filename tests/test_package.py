"""What a user meets first, outside the ops: the version, the decision log,
the scripts' --help, and what the examples say about CPU timings."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

import b12x_jax
from b12x_jax.policy import MAX_DECISIONS, Decision

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
SCRIPTS = sorted(p for folder in ("examples", "benchmarks") for p in glob.glob(os.path.join(ROOT, folder, "*.py"))
                 if not os.path.basename(p).startswith("_"))


def test_version_is_the_one_pyproject_declares():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    assert b12x_jax.__version__ == tomllib.load(f)["project"]["version"]


def test_decisions_is_a_list_that_keeps_the_last_ones():
  comm = b12x_jax.Communicator()
  for i in range(MAX_DECISIONS + 5):
    comm.record(Decision("all_reduce", "default", "b12x", str(i)))
  assert isinstance(comm.decisions, list) and len(comm.decisions) == MAX_DECISIONS
  assert [d.reason for d in comm.decisions[-2:]] == [str(MAX_DECISIONS + 3), str(MAX_DECISIONS + 4)]
  assert comm.decisions[0].reason == "5"


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_help_shows_every_default(script):
  proc = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-2000:]
  options = [o for o in re.findall(r"^  (--?[\w-]+)", proc.stdout, flags=re.M) if o not in ("-h", "--help")]
  assert len(re.findall(r"\(default:\s", proc.stdout)) == len(options), proc.stdout


def test_every_scratch_build_of_the_ablation_applies_to_this_tree_and_compiles(tmp_path):
  """benchmarks/ablate.sh edits ffi/cuda/ by pattern: an edit that no longer
  matches the sources would time the unedited kernel under its name."""
  script = os.path.join(ROOT, "benchmarks", "ablate.sh")
  with open(script) as f:
    builds = re.findall(r'^  "([^|]+)\|', f.read(), flags=re.M)
  proc = subprocess.run(["bash", script, "--check"], capture_output=True, text=True, timeout=600,
                        env={**os.environ, "PYTHON": sys.executable, "ABLATE_DIR": str(tmp_path / "ablate")})
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  assert len(builds) >= 7 and re.findall(r"^== (.*): applies$", proc.stdout, flags=re.M) == builds, proc.stdout


def test_the_ablation_times_another_trees_kernels_only_where_they_differ(tmp_path):
  """benchmarks/ablate.sh with ABLATE_KERNELS builds this tree with each of
  other trees' b12x_jax/kernels (timed beside this tree's in one run); a
  folder that holds this tree's own kernels would time them twice under two
  names."""
  script = os.path.join(ROOT, "benchmarks", "ablate.sh")
  others = [tmp_path / "one", tmp_path / "two"]
  for other in others:
    shutil.copytree(os.path.join(ROOT, "b12x_jax", "kernels"), other / "b12x_jax" / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
  env = {**os.environ, "PYTHON": sys.executable, "ABLATE_DIR": str(tmp_path / "ablate"),
         "ABLATE_KERNELS": ":".join(map(str, others)), "ABLATE_ONLY": "the kernels of"}
  with open(others[0] / "b12x_jax" / "kernels" / "exchange.py", "a") as f:
    f.write("\nCHECK_EVERY = 16\n")
  same = subprocess.run(["bash", script, "--check"], capture_output=True, text=True, timeout=120, env=env)
  assert same.returncode != 0 and f"the kernels of {others[1]}: the same b12x_jax/kernels" in same.stdout, \
      same.stdout + same.stderr
  with open(others[1] / "b12x_jax" / "kernels" / "exchange.py", "a") as f:
    f.write("\nCHECK_EVERY = 4\n")
  proc = subprocess.run(["bash", script, "--check"], capture_output=True, text=True, timeout=120, env=env)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  assert re.findall(r"^== (.*): applies$", proc.stdout, flags=re.M) == [f"triton: the kernels of {other}"
                                                                       for other in others], proc.stdout
  with open(others[1] / "b12x_jax" / "kernels" / "exchange.py", "a") as f:
    f.write("\nCHECK_EVERY =\n")
  broken = subprocess.run(["bash", script, "--check"], capture_output=True, text=True, timeout=120, env=env)
  assert broken.returncode != 0 and "exchange.py does not compile" in broken.stdout, broken.stdout + broken.stderr


def test_the_breakdown_counts_each_kernel_of_ncus_csv_for_its_own_kind(tmp_path, monkeypatch):
  """benchmarks/breakdown.py --kernels reads ncu's CSV by kernel name (as
  Nsight Compute prints them): each launch counts for its own kind, in
  launch order and in us; other kernels and metrics count for none."""
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
  import breakdown
  names = {
      "ffi": "void b12x::<unnamed>::lamport_all_reduce<0>(b12x::ChannelView, b12x::Plan, b12x::CallTag)",
      "triton": "b12x_all_reduce_lamport_breakdown_triton",
      "floor": "floor_exchange",
      "empty ffi": "b12x::<unnamed>::empty_kernel()",
      "ffi dcp": "void b12x::<unnamed>::dcp_a2a_lamport_kernel<1, 1>(b12x::ChannelView, b12x::DcpShape)",
      "triton dcp": "b12x_dcp_a2a_lamport_breakdown_triton_dcp",
      "ffi fused": "void b12x::<unnamed>::residual_rmsnorm_kernel<1, 1>(b12x::ChannelView, b12x::RowsShape)",
      "triton fused": "b12x_residual_rmsnorm_lamport_breakdown_triton_fused",
  }
  assert set(names) == set(breakdown.KERNELS)
  header = ["ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"]
  lines = ["==PROF== Connected to process 1 (python3)", ",".join(f'"{h}"' for h in header)]
  want = {}
  for launch in range(2):
    for i, (kind, name) in enumerate([*names.items(), ("other", "loop_convert_fusion")]):
      ns = 1000 * (i + 1) + 10 * launch
      unit, value = ("usecond", f"{ns / 1000}") if launch else ("nsecond", f"{ns:,}")
      lines.append(",".join(f'"{v}"' for v in (len(lines), name, "gpu__time_duration.sum", unit, value)))
      lines.append(",".join(f'"{v}"' for v in (len(lines), name, "sm__cycles_elapsed.avg", "cycle", "99")))
      if kind != "other":
        want.setdefault(kind, []).append(ns / 1000)
  (tmp_path / "k.csv").write_text("\n".join(lines) + "\n")
  runs = breakdown.kernel_us(str(tmp_path / "k.csv"))
  assert {kind: [round(us, 6) for us in durations] for kind, durations in runs.items()} == want


def test_the_ablation_times_another_trees_ffi_kernels_beside_this_trees_build(tmp_path):
  """benchmarks/ablate.sh with ABLATE_FFI times this tree as built, then a
  build with each of other trees' ffi/ (every op through loopback); a folder
  that holds this tree's own ffi/ would time it twice under two names."""
  script = os.path.join(ROOT, "benchmarks", "ablate.sh")
  others = [tmp_path / "one", tmp_path / "two"]
  for other in others:
    shutil.copytree(os.path.join(ROOT, "ffi"), other / "ffi")
  env = {**os.environ, "PYTHON": sys.executable, "ABLATE_DIR": str(tmp_path / "ablate"),
         "ABLATE_FFI": ":".join(map(str, others)), "ABLATE_ONLY": "^ffi: "}
  with open(others[0] / "ffi" / "cuda" / "dcp_a2a.cu", "a") as f:
    f.write("\n// another tree\n")
  same = subprocess.run(["bash", script, "--check"], capture_output=True, text=True, timeout=300, env=env)
  assert same.returncode != 0 and f"the kernels of {others[1]}: the same ffi" in same.stdout, same.stdout + same.stderr
  with open(others[1] / "ffi" / "cuda" / "residual_rmsnorm.cu", "a") as f:
    f.write("\n// a third tree\n")
  proc = subprocess.run(["bash", script, "--check"], capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  assert re.findall(r"^== (.*): applies$", proc.stdout, flags=re.M) == ["ffi: as built"] + [
      f"ffi: the kernels of {other}" for other in others], proc.stdout
  if shutil.which("nvcc") is not None:  # a kernel whose source differs is compiled
    with open(others[1] / "ffi" / "cuda" / "residual_rmsnorm.cu", "a") as f:
      f.write("\nnot C++\n")
    broken = subprocess.run(["bash", script, "--check"], capture_output=True, text=True, timeout=300, env=env)
    assert broken.returncode != 0 and "residual_rmsnorm.cu does not compile" in broken.stdout, \
        broken.stdout + broken.stderr


def test_the_ablation_times_ffi_builds_under_ncu_where_asked(tmp_path):
  """benchmarks/ablate.sh with ABLATE_NCU=1 profiles each FFI build with
  Nsight Compute and hands its CSV to breakdown.py (a "dcp:" build: dcp_a2a;
  another tree's ffi/: every FFI op), caches flushed before each kernel
  unless ABLATE_NCU_CACHE says otherwise; without it, no ncu. Run with stand-in
  ncu and python that write their arguments, one a line (no GPU here)."""
  stubs = tmp_path / "bin"
  stubs.mkdir()
  log = tmp_path / "calls.log"
  (stubs / "ncu").write_text(f'#!/bin/bash\nprintf "%s\\n" ncu "$@" -- >> {log}\n')
  (stubs / "py").write_text(f'#!/bin/bash\nprintf "%s\\n" py "$@" -- >> {log}\n'
                            '[ "$1" = -m ] || printf "%s\\n" "   4 KiB      ffi dcp     7.00       6.00     1.00" '
                            '"   1 x 8 x 128     7.56"\n')
  for stub in stubs.iterdir():
    stub.chmod(0o755)
  other = tmp_path / "other"
  shutil.copytree(os.path.join(ROOT, "ffi"), other / "ffi")
  with open(other / "ffi" / "cuda" / "dcp_a2a.cu", "a") as f:
    f.write("\n// another tree\n")
  env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "PYTHON": str(stubs / "py"),
         "ABLATE_DIR": str(tmp_path / "ablate"), "ABLATE_FFI": str(other),
         "ABLATE_ONLY": "^(dcp: as built|ffi: the kernels)"}

  def calls(ncu: bool, **more: str) -> list[list[str]]:
    log.unlink(missing_ok=True)
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "ablate.sh"), "4096"], capture_output=True,
                          text=True, timeout=120, env={**env, "ABLATE_NCU": "1" if ncu else "", **more})
    # each build's rows of its timer's table: breakdown.py's by size, loopback_kernels.py's by shape
    rows = ["4 KiB"] * 2 if ncu else ["4 KiB", "1 x 8 x 128"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.findall(r"^ +(4 KiB|1 x 8 x 128) ", proc.stdout, flags=re.M) == rows, proc.stdout
    words = log.read_text().split("\n--\n")
    return [w.split("\n") for w in words if w.strip() and "pip" not in w]

  def profile(cache: str) -> list[str]:
    return ["--clock-control", "none", "--cache-control", cache, "--graph-profiling", "node", "--metrics",
            "gpu__time_duration.sum", "-k", "regex:lamport|rmsnorm", "--csv", str(stubs / "py"), "breakdown.py",
            "--profile"]

  csv = str(tmp_path / "ablate" / "kernels.csv")
  timed = ["--sizes", "4096", "--iters", "15", "--kernels", csv]
  for cache, more in (("all", {}), ("none", {"ABLATE_NCU_CACHE": "none"})):
    assert calls(ncu=True, **more) == [
        ["ncu", *profile(cache), "--kinds", "ffi dcp", "--sizes", "4096"],
        ["py", "breakdown.py", "--kinds", "ffi dcp", *timed],
        ["ncu", *profile(cache), "--kinds", "ffi,ffi dcp,ffi fused", "--sizes", "4096"],
        ["py", "breakdown.py", "--kinds", "ffi,ffi dcp,ffi fused", *timed]], cache
  assert calls(ncu=False) == [["py", "breakdown.py", "--kinds", "ffi dcp", "--sizes", "4096", "--iters", "15"],
                              ["py", "loopback_kernels.py", "--kernels", "ffi", "--iters", "15"]]


def _default_real_architectures() -> list[str]:
  """The real architectures of CMakeLists.txt's default build that this
  nvcc knows, e.g. ["80", "90"]."""
  with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
    archs = re.search(r'set\(_b12x_default_archs "([^"]+)"\)', f.read()).group(1)
  known = subprocess.run(["nvcc", "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout.split()
  return [a for a in (a.removesuffix("-real") for a in archs.split(";") if a.endswith("-real")) if f"compute_{a}" in known]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc here: the CUDA kernels are not built")
def test_the_cuda_kernels_keep_their_state_in_registers(tmp_path):
  """ptxas's report of every kernel of the collectives, for each real
  architecture of the default build: no spills and no stack. A source's
  pack loaded through a reference into the staging array kept the array in
  local memory, a round trip through L1 in every call; and a 512-thread
  kernel without one block an SM in its launch bounds was held to 64
  registers and spilled on sm_80/100/120 (docs/DESIGN.md, "Lamport"). The
  fused kernel's 1024 threads leave it 64 registers whatever the bounds:
  it is held to none on sm_90 only (the architecture measured)."""
  import jax.ffi
  archs = _default_real_architectures()
  assert "90" in archs, archs
  gencode = [flag for a in archs for flag in ("-gencode", f"arch=compute_{a},code=sm_{a}")]
  frames = {}
  for source in ("all_reduce", "residual_rmsnorm", "dcp_a2a"):
    proc = subprocess.run(["nvcc", "-std=c++17", "-O3", *gencode, "-DB12X_WITH_CUDA=1", "-Xptxas", "-v",
                           "-isystem", jax.ffi.include_dir(), "-c", os.path.join(ROOT, "ffi", "cuda", f"{source}.cu"),
                           "-o", str(tmp_path / f"{source}.o")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = re.findall(r"Compiling entry function '(\S+)' for 'sm_(\d+)'\n.*\n\s*(\d+) bytes stack frame, (\d+) "
                         r"bytes spill stores", proc.stderr)
    # every kernel's report read, each architecture's kernels alike
    assert len(reports) == proc.stderr.count("Compiling entry function") > 0, proc.stderr[-3000:]
    assert sorted(arch for _, arch, _, _ in reports) == sorted(archs * (len(reports) // len(archs))), reports
    for name, arch, stack, spills in reports:
      if "residual_rmsnorm_kernel" not in name or arch == "90":
        frames[name, arch] = (int(stack), int(spills))
  assert len(frames) >= 8 * len(archs), frames  # the all_reduce and dcp kernels of each dtype, each architecture
  assert all(frame == (0, 0) for frame in frames.values()), {k: v for k, v in frames.items() if v != (0, 0)}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc here: the CUDA kernels are not built")
def test_every_world_gets_the_smallest_lamport_kernel_that_holds_it(tmp_path):
  """by_ranks (ffi/cuda/lamport.cuh), which picks a Lamport kernel's unroll
  bound over sources: a bound below the world would skip a source (the
  kernel traps then); one above it is a longer path (docs/DESIGN.md,
  "Lamport"). Run on the host: it is host code."""
  import jax.ffi
  source = tmp_path / "by_ranks.cu"
  source.write_text('#include <cstdio>\n#include "ffi/cuda/lamport.cuh"\n'
                    "int main() { for (int w = 1; w <= b12x::kMaxRanks; ++w) "
                    'std::printf("%d ", b12x::by_ranks(w, [](auto ranks) { return ranks.value; })); }\n')
  build = subprocess.run(["nvcc", "-std=c++17", "-I", ROOT, "-isystem", jax.ffi.include_dir(), str(source), "-o",
                          str(tmp_path / "by_ranks")], capture_output=True, text=True, timeout=600)
  assert build.returncode == 0, build.stderr[-3000:]
  picked = subprocess.run([str(tmp_path / "by_ranks")], capture_output=True, text=True, timeout=60).stdout.split()
  assert [int(k) for k in picked] == [2, 2, 4, 4, 8, 8, 8, 8]


@pytest.mark.parametrize("example", ["dcp_decode.py", "speculative_decoding.py"])
def test_timing_examples_say_cpu_timings_measure_the_emulation(example):
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", example), "--help"], capture_output=True,
                        text=True, timeout=60)
  assert "timings measure the emulation" in " ".join(proc.stdout.split())


def test_dcp_example_prints_the_note_next_to_cpu_timings():
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "dcp_decode.py"), "--batch", "2", "--heads",
                         "4", "--head-dim", "64", "--kv-len", "16", "--steps", "2"], capture_output=True, text=True,
                        timeout=300, env={**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
                                                 "JAX_PLATFORMS": "cpu"})  # the example's own 2 devices
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "timings measure the emulation" in proc.stdout


def test_an_extension_the_runtime_would_refuse_is_named_at_import_with_both_versions():
  from b12x_jax import _b12x, _native
  assert _native.ffi_api_mismatch(tuple(_b12x.ffi_api_version()), _b12x.built_jaxlib, _native._runtime_ffi_api(),
                                  "this") is None  # the build CI tests runs here
  message = _native.ffi_api_mismatch((0, 5), "0.12.0.1", (0, 4), "0.11.2")
  assert "built against jaxlib 0.12.0.1 (XLA FFI API 0.5)" in message and "jaxlib 0.11.2 (XLA FFI API 0.4)" in message
  assert "pip install --force-reinstall" in message
  assert _native.ffi_api_mismatch((0, 4), "0.11.2", (0, 5), "0.12.0.1") is None  # newer runtimes take older handlers
  assert _native.ffi_api_mismatch((1, 0), "x", (0, 9), "y") is not None and \
      _native.ffi_api_mismatch((0, 4), "x", None, "y") is None
