"""The Triton kernels compiled for an H200 without a GPU.

The CPU tests trace the Pallas Triton kernels but never compile them: XLA
does that on a GPU, with its own Triton. A kernel XLA's Triton cannot
compile passes every CPU test and crashes each process on a GPU (benchmarks/
RESULTS.md, 2026-12-05: a segfault in TritonGPURemoveLayoutConversions);
pip's triton 3.6.0 failed the same way on CPU. So where one is at hand, each
kernel's Triton IR, as Pallas lowers it for an H200, is compiled to SASS
with it: the Python that ``B12X_TRITON_PYTHON`` names (.ci/run makes one),
else this one where it imports triton. A stand-in for the Triton of jaxlib
0.11 only (jax 0.12's is another), not the same build: a GPU run stays the
proof.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys

import jax
import pytest
from test_triton_kernels import triton_kernel_case

_STAND_IN = "3.6."  # the pip triton that stands in for jaxlib 0.11's

_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
if not triton.__version__.startswith(sys.argv[3]):
  print("version", triton.__version__)
  sys.exit(0)
path, warps = sys.argv[1], int(sys.argv[2])
kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})
for kind in ("ttgir", "ptx"):
  with open(path + "." + kind, "w") as f:
    f.write(kernel.asm[kind])
print("compiled", triton.__version__, len(kernel.asm["cubin"]))
"""


def _triton_python() -> str | None:
  named = os.environ.get("B12X_TRITON_PYTHON")
  if named:
    return named
  return sys.executable if importlib.util.find_spec("triton") else None


pytestmark = [
    pytest.mark.skipif(_triton_python() is None, reason="no Triton to compile with: set B12X_TRITON_PYTHON to a "
                       "Python with triton (pip install triton==3.6.0)"),
    pytest.mark.skipif(not jax.__version__.startswith("0.11."), reason=f"jax {jax.__version__}: pip's triton "
                       f"{_STAND_IN}x stands in for the Triton of jaxlib 0.11 only"),
]


def _lowered(monkeypatch, trace) -> list[tuple[str, int]]:
  """(Triton IR, warps) of every Pallas Triton kernel ``trace`` lowers for an H200."""
  from jax._src.pallas.triton import lowering, pallas_call_registration
  from jax.experimental.pallas import triton as plt

  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                      lambda: plt.get_gpu_info_from_version(plt.GpuVersion.H200))
  modules, warps = [], []
  lower = lowering.lower_jaxpr_to_triton_module

  def keep(*args, **kwargs):
    result = lower(*args, **kwargs)
    modules.append(result.module.operation.get_asm())
    return result

  params = plt.CompilerParams

  def note_warps(**options):
    warps.append(options["num_warps"])
    return params(**options)

  monkeypatch.setattr(pallas_call_registration.lowering, "lower_jaxpr_to_triton_module", keep)
  monkeypatch.setattr(plt, "CompilerParams", note_warps)
  trace()
  assert modules and len(modules) == len(warps), (len(modules), warps)
  return list(zip(modules, warps))


_LAYOUT = re.compile(r"^(#\w+) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], threadsPerWarp = \[([\d, ]+)\], "
                     r"warpsPerCTA = \[([\d, ]+)\]", re.M)


def _copies_of_a_stored_element(ttgir: str, store: str) -> list[tuple[str, int]]:
  """(tensor type, threads holding each element) of every ``store`` inline
  asm in ``ttgir``: a blocked layout covers sizePerThread x threadsPerWarp
  x warpsPerCTA elements along each axis; along an axis shorter than that,
  several threads hold each element (sizes are powers of two)."""
  layouts = {name: [[int(n) for n in part.split(",")] for part in parts]
             for name, *parts in _LAYOUT.findall(ttgir)}
  found = []
  for line in ttgir.splitlines():
    if "tt.elementwise_inline_asm" not in line or store not in line:
      continue
    shape, layout = re.search(r"-> tensor<([\dx]+)xi32, (#\w+)>", line).groups()
    assert layout in layouts, f"a layout this test does not read: {layout}\n{ttgir[:2000]}"
    copies = 1
    for size, *cover in zip(map(int, shape.split("x")), *layouts[layout]):
      copies *= max(1, math.prod(cover) // size)
    found.append((f"tensor<{shape}, {layout}>", copies))
  return found


@pytest.mark.parametrize("name", ["all_reduce float32", "all_reduce bfloat16", "all_reduce loopback",
                                  "all_reduce bfloat16, 8 ranks", "dcp_a2a", "fused, one program a row",
                                  "fused, a row over 4 programs", "fused, a wide row in one program",
                                  "fused, a row over 2 programs"])
def test_every_triton_kernel_compiles_for_an_h200(monkeypatch, tmp_path, name):
  fn, args = triton_kernel_case(name)
  ((module, warps),) = _lowered(monkeypatch, lambda: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)))
  path = tmp_path / "kernel.ttir"
  path.write_text(module)
  proc = subprocess.run([_triton_python(), "-c", _COMPILE, str(path), str(warps), _STAND_IN], capture_output=True,
                        text=True, timeout=600, cwd=tmp_path, env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path)})
  if proc.returncode == 0 and proc.stdout.startswith("version"):
    pytest.skip(f"triton {proc.stdout.split()[1]} at {_triton_python()}, not the stand-in {_STAND_IN}x")
  failed = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "Pipeline failed" in line]
  assert proc.returncode == 0 and "compiled" in proc.stdout, (
      f"rc={proc.returncode}\n" + ("\n".join(failed[-5:]) or proc.stderr[-3000:]))
  # Each word a peer reads is stored by one thread (docs/DESIGN.md, "Lamport"): dcp_a2a's lse, a
  # tensor<8xi32> over 128 threads, was stored by 16.
  from b12x_jax import kernels as triton
  # So is a split row's share slot, and its add to the meeting word (added twice, the word would never
  # again be a multiple of 65536 between calls).
  ttgir = (tmp_path / "kernel.ttir.ttgir").read_text()
  for store, code in [("@p st.volatile.global.u32 [a], $4", triton.exchange._STORE),
                      ("st.relaxed.gpu.global.u64", triton.exchange._STORE_SLOT),
                      ("red.relaxed.gpu.global.add.u32", triton.exchange._ADD)]:
    assert store in code
    stores = _copies_of_a_stored_element(ttgir, store)
    assert all(copies == 1 for _, copies in stores), (store, stores)
    assert bool(stores) == (code is triton.exchange._STORE or name.startswith("fused, a row over")), (store, stores)
  # A split row's programs meet without a fence or an acquire: each share travels with its call's tag
  # in one 64-bit word (an acquire is issued once per element a thread holds, one round trip after the
  # other; a release waits for every store the thread issued before it, the Lamport pushes too).
  ptx = (tmp_path / "kernel.ttir.ptx").read_text()
  assert "ld.acquire" not in ptx and "red.release" not in ptx, name
  slots = ptx.count("ld.relaxed.gpu.global.u64")
  assert (slots > 0) == name.startswith("fused, a row over"), f"{slots} 64-bit slot loads in the PTX"
