"""Where a loopback call's microseconds go, on one GPU (docs/DESIGN.md,
"Loopback"): the FFI and the Triton all_reduce and their two floors
(loopback_kernels.py: the protocol-free exchange of the same bytes, an FFI
call of one empty kernel), float32, and the FFI and Triton dcp_a2a and
fused op of the same bytes (bfloat16: dcp_a2a as B x 16 x 128, the fused op
as rows of 2048 or 8192), each one executable of `--ops` chained calls.
Per op: the wall time (median of `--iters`, per_op_us) and, from
Nsight Compute, each kernel's own duration on the GPU; wall minus kernel is
what XLA's CUDA graph spends between kernels.

The kernel durations come from a run of this script under ncu that runs
each executable once (`--profile`, 8 ops each), written as CSV and read
back with `--kernels`:

  ncu --clock-control none --graph-profiling node --metrics gpu__time_duration.sum \
      -k regex:'lamport|rmsnorm|empty_kernel|floor_exchange' --csv python benchmarks/breakdown.py --profile > k.csv
  python benchmarks/breakdown.py --kernels k.csv [--backends]

ncu flushes the caches before each kernel it profiles (its default
`--cache-control all`): every line a kernel touches then comes from DRAM.
In a chain of calls, as in the wall times, each kernel finds the previous
one's lines in L2: `--cache-control none` times them so (benchmarks/
RESULTS.md, thirty-fourth session: 0.58-0.67 us of the FFI all_reduce
kernel's duration at 4 and 64 KiB was the flush).

`--backends` adds the launch floor of a trivial kernel on each Pallas GPU
backend (Triton, Mosaic GPU), the measure by which a move off the
deprecated Pallas Triton backend is judged.
"""

from __future__ import annotations

import argparse
import collections
import csv
import functools
import sys

import jax
import numpy as np
from _common import per_op_us, size_label
from loopback_kernels import chained, chained_dcp, chained_fused, empty_ffi_call, exchange_floor, put, random

import b12x_jax

# The kernel each executable launches, as ncu names it.
KERNELS = {"ffi": "lamport_all_reduce", "triton": "b12x_all_reduce_lamport", "floor": "floor_exchange",
           "empty ffi": "empty_kernel", "ffi dcp": "dcp_a2a_lamport_kernel", "triton dcp": "b12x_dcp_a2a_lamport",
           "ffi fused": "residual_rmsnorm_kernel", "triton fused": "b12x_residual_rmsnorm_lamport"}


def kernel_us(path: str) -> dict[str, list[float]]:
  """Each kind's kernel durations in us, in launch order, from ncu's CSV at
  ``path`` (of a `--profile` run)."""
  rows = [r for r in csv.DictReader(line for line in open(path) if line.startswith('"'))
          if r["Metric Name"] == "gpu__time_duration.sum"]
  scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "nsecond": 1e-3}
  runs = collections.defaultdict(list)  # kernel -> [durations], in launch order
  for r in rows:
    kind = next((k for k, name in KERNELS.items() if name in r["Kernel Name"]), None)
    if kind is not None:
      runs[kind].append(float(r["Metric Value"].replace(",", "")) * scale[r["Metric Unit"]])
  return runs


def executables(mesh, size: int, ops: int, rng):
  """(kind, jitted fn, arguments) for each executable at ``size``."""
  x = put(mesh, random(rng, size, "float32"))
  words = jax.numpy.asarray(rng.standard_normal(size // 4).astype(np.float32).view(np.int32))
  batch = max(1, size // 4096)
  out = put(mesh, random(rng, size, "bfloat16").reshape(batch, -1, 128))
  lse = put(mesh, rng.standard_normal(out.shape[:2]).astype(np.float32))
  rows = max(1, size // 16384)
  hidden = size // 2 // rows
  normed = put(mesh, random(rng, size, "bfloat16").reshape(rows, hidden))
  residual = jax.numpy.asarray(random(rng, size, "bfloat16").reshape(rows, hidden))
  weight = jax.numpy.asarray((1 + 0.1 * rng.standard_normal(hidden)).astype(jax.numpy.bfloat16))
  return [("ffi", chained(mesh, ops), (x,)), ("triton", chained(mesh, ops), (x,)),
          ("floor", exchange_floor(size // 4, ops), (words,)), ("empty ffi", empty_ffi_call(ops), (words,)),
          ("ffi dcp", chained_dcp(mesh, ops), (out, lse)), ("triton dcp", chained_dcp(mesh, ops), (out, lse)),
          ("ffi fused", chained_fused(mesh, ops, True), (normed, residual, weight)),
          ("triton fused", chained_fused(mesh, ops, True), (normed, residual, weight))]


def backend_floors(ops: int, iters: int) -> dict[str, str]:
  """us per op of a trivial kernel (x + 1 on 1024 float32) on each Pallas
  GPU backend, ``ops`` chained in one executable, result checked: the
  launch floor a kernel of that backend cannot go below (docs/DESIGN.md,
  "Triton kernels"). Mosaic GPU is tried two ways (jax 0.11's pallas_call
  of that backend, with blocks in shared memory, and ``plgpu.kernel`` on
  global refs), and the same kernel in the Triton language through
  jax_triton (the official bindings JAX's deprecation names), where it is
  installed. A way that fails says why instead."""
  from jax.experimental import pallas as pl

  def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0

  def pallas_triton(v):
    from jax.experimental.pallas import triton as plt
    return pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
                          compiler_params=plt.CompilerParams(num_warps=4, num_stages=1))(v)

  def mosaic_pallas_call(v):
    from jax._src.pallas.mosaic_gpu.pallas_call import pallas_call  # jax 0.11: not public
    spec = pl.BlockSpec(v.shape, lambda: (0,))
    return pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype), in_specs=[spec],
                       out_specs=spec)(v)

  def mosaic_kernel(v):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.kernel(add_one, out_type=jax.ShapeDtypeStruct(v.shape, v.dtype))(v)

  def jax_triton(v):  # the official Triton bindings (not a dependency: measured where installed)
    import jax_triton as jt
    return jt.triton_call(v, kernel=_triton_add_one(), out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
                          grid=(1,), num_warps=4, num_stages=1, n=v.size)

  x = jax.numpy.arange(1024, dtype=np.float32)
  out = {}
  for name, op in (("pallas triton", pallas_triton), ("mosaic gpu, pallas_call", mosaic_pallas_call),
                   ("mosaic gpu, kernel", mosaic_kernel), ("jax_triton", jax_triton)):
    try:
      def body(v, op=op):
        for _ in range(ops):
          v = op(v)
        return v
      fn = jax.jit(body)
      assert np.array_equal(np.asarray(fn(x)), np.arange(1024, dtype=np.float32) + ops), name
      out[name] = f"{per_op_us(lambda: fn(x), ops, iters):.2f}"
    except Exception as e:  # noqa: BLE001 - one way's failure must not hide the others' numbers
      out[name] = f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
  return out


@functools.cache
def _triton_add_one():
  """add_one as a kernel of the Triton language, for jax_triton."""
  import triton
  import triton.language as tl

  @triton.jit
  def add_one(x_ptr, o_ptr, n: tl.constexpr):
    i = tl.arange(0, n)
    tl.store(o_ptr + i, tl.load(x_ptr + i) + 1.0)
  return add_one


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--sizes", default="4096,65536", help="payload bytes, comma-separated")
  parser.add_argument("--ops", type=int, default=256, help="chained calls per executable")
  parser.add_argument("--iters", type=int, default=20, help="timed runs (the median is reported)")
  parser.add_argument("--kinds", default=",".join(KERNELS), help="which executables, comma-separated")
  parser.add_argument("--profile", action="store_true", help="run each executable once (under ncu), no timing")
  parser.add_argument("--kernels", help="ncu's CSV of a --profile run: print each kernel's duration beside")
  parser.add_argument("--backends", action="store_true", help="also the launch floor of each Pallas GPU backend")
  args = parser.parse_args()
  if jax.default_backend() != "gpu":
    sys.exit("breakdown.py needs a GPU")
  sizes = [int(s) for s in args.sizes.split(",")]
  ops = 8 if args.profile else args.ops
  runs = kernel_us(args.kernels) if args.kernels else {}
  mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
  rng = np.random.default_rng(0)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, loopback, {ops} chained ops "
        f"(all_reduce float32; dcp_a2a and the fused op bfloat16)")
  print(f"{'size':>8} {'kind':>12} {'wall us':>8} {'kernel us':>10} {'between':>8}")
  for index, size in enumerate(sizes):
    for kind, fn, operands in executables(mesh, size, ops, rng):
      if kind not in args.kinds.split(","):
        continue
      comm = b12x_jax.Communicator(loopback=True, kernels="triton" if kind.startswith("triton") else "ffi")
      b12x_jax.get_communicator().close()
      b12x_jax.set_communicator(comm)
      with b12x_jax.channel(f"breakdown-{kind.replace(' ', '-')}"):
        if args.profile:
          for _ in range(2):  # a warm run, then the profiled one
            jax.block_until_ready(fn(*operands))
        else:
          wall = per_op_us(lambda: fn(*operands), ops, args.iters)
      comm.check_errors()
      comm.close()
      if args.profile:
        continue
      # A --profile run launches each kind 2 x 8 times per size, sizes in order: this size's profiled 8.
      launches = runs.get(kind, [])
      if args.kernels and len(launches) != 16 * len(sizes):
        sys.exit(f"{args.kernels} holds {len(launches)} launches of the {kind} kernel, not 16 per size of "
                 f"{args.sizes}: profile with the same --sizes and --kinds")
      mine = launches[16 * index + 8:16 * index + 16]
      kernel = float(np.median(mine)) if mine else float("nan")
      print(f"{size_label(size):>8} {kind:>12} {wall:8.2f} {kernel:10.2f} {wall - kernel:8.2f}")
  if args.backends and not args.profile:
    print(f"\na trivial kernel (x + 1, 1024 float32), {ops} chained, us per op")
    for backend, result in backend_floors(ops, args.iters).items():
      print(f"{backend:>24} {result}")


if __name__ == "__main__":
  main()
