"""Per-op time of all_reduce vs jax.lax.psum, in one run.

Each measurement is one executable of `--ops` chained collectives (each
consumes the previous result: independent collectives get combined by XLA
and time as nothing), timed over `--iters` runs after warm-up; the table
shows the median per op, a second one the bus bandwidth 2(N-1)/N * size / t.
Columns (impls):
  b12x          all_reduce with the default Communicator (Lamport up to 1 MiB,
                then the algorithm of b12x_jax.tuning), capacity_bytes = the
                largest size, so every size runs on b12x
  b12x_barrier  all_reduce with the Lamport path off (lamport_bytes=0)
  b12x_one_shot, b12x_two_shot, b12x_one_shot_pull   the algorithm forced above
                the Lamport window (push one-shot, push two-shot, pull one-shot);
                a suffix _blocksN caps the grid at N blocks (max_blocks)
  b12x_triton   all_reduce with Communicator(kernels="triton"): the Pallas
                Triton kernel in the Lamport window (a cell marked "ffi
                kernel" where it fell back), the FFI kernels above it
  psum          jax.lax.psum
  floor         a custom call that launches an empty kernel (GPU only): what
                XLA charges per FFI call, the floor under any collective
Columns that need other XLA flags (psum with XLA's one-shot kernel, b12x and
floor with command buffers off) run in subprocesses: flags are read at start.

  python benchmarks/all_reduce.py            # GPUs if >= 2, else CPU devices
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

from _common import add_timing_arguments, gpu_count, per_op_us, size_label

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20, 32 << 20]
IMPL = re.compile(r"b12x(?P<barrier>_barrier)?(?:_(?P<algorithm>one_shot_pull|one_shot|two_shot))?(?:_blocks(?P<blocks>\d+))?"
                  r"(?P<triton>_triton)?")
ONESHOT_FLAG = "--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE"
NO_GRAPHS = "--xla_gpu_enable_command_buffer="
# The baselines run in child processes on the same GPUs: no preallocation.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Emulated CPU devices for machines without GPUs (no effect on GPU runs).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def measure(impls: list[str], sizes: list[int], ops: int, iters: int, devices: int) -> dict:
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax

  platform = "gpu" if gpu_count() >= 2 else "cpu"
  mesh = jax.make_mesh((devices,), ("x",), devices=jax.devices(platform)[:devices])
  results: dict = {}
  for impl in impls:
    if impl.startswith("b12x"):
      b12x_jax.get_communicator().close()
      b12x_jax.set_communicator(b12x_jax.Communicator(**_options(impl, max(sizes))))
    op = _op(impl)

    def body(x, op=op):
      for _ in range(ops):
        x = op(x)
      return x

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    for size in sizes:
      elems = size // 2
      x = jax.device_put(jnp.ones((devices * elems,), jnp.bfloat16) * 1e-3, NamedSharding(mesh, P("x")))
      with b12x_jax.channel("bench"):
        us = per_op_us(lambda: fn(x), ops, iters)
      last = b12x_jax.get_communicator().decisions[-1] if impl.startswith("b12x") else None
      results.setdefault(str(size), {})[impl] = {"us": us, "path": last.path if last else impl,
                                                 "kernel": last.kernel if last else None}
  b12x_jax.check_errors()
  return results


def _options(impl: str, capacity: int) -> dict:
  """Communicator settings of a b12x column (see IMPL)."""
  match = IMPL.fullmatch(impl)
  if match is None:
    raise ValueError(f"unknown impl {impl!r}")
  options = {"capacity_bytes": max(capacity, 8 << 20)}
  if match["barrier"]:
    options["lamport_bytes"] = 0
  if match["algorithm"]:
    options["algorithm"] = match["algorithm"]
  if match["blocks"]:
    options["max_blocks"] = int(match["blocks"])
  if match["triton"]:
    options["kernels"] = "triton"
  return options


def peer_copy_gbps(nbytes: int = 256 << 20, iters: int = 10) -> float:
  """GPU 0 -> GPU 1 copy bandwidth of one large buffer (XLA's device-to-device
  copy): the link speed the bus bandwidth is compared with."""
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np
  src, dst = jax.devices("gpu")[:2]
  x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), src)
  jax.device_put(x, dst).block_until_ready()
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.device_put(x, dst).block_until_ready()
    times.append(time.perf_counter() - start)
  return nbytes / float(np.median(times)) / 1e9


def _op(impl: str):
  import jax

  import b12x_jax
  from b12x_jax import _native
  if impl.startswith("b12x"):
    return lambda x: b12x_jax.all_reduce(x, "x")
  if impl == "psum":
    return lambda x: jax.lax.psum(x, "x")
  if impl == "floor":
    _native.ensure_registered()
    # Output aliases input: a chain of empty kernels, nothing copied.
    return lambda x: jax.ffi.ffi_call("b12x_dispatch_probe", jax.ShapeDtypeStruct(x.shape, x.dtype),
                                      has_side_effect=True, input_output_aliases={0: 0})(x)
  raise ValueError(f"unknown impl {impl!r}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  add_timing_arguments(parser)
  parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="payload bytes, comma-separated")
  parser.add_argument("--impls", default=None,
                      help="comma-separated; when not given, b12x,b12x_barrier,psum,floor on GPUs, b12x,psum on CPU")
  parser.add_argument("--no-flag-columns", action="store_true", help="skip the columns measured in subprocesses")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  sizes = [int(s) for s in args.sizes.split(",")]
  args.impls = args.impls or ("b12x,b12x_triton,b12x_barrier,psum,floor" if gpu_count() >= 2 else "b12x,psum")
  if args.child:
    print("RESULT " + json.dumps(measure(args.impls.split(","), sizes, args.ops, args.iters, args.devices)))
    return
  results = measure(args.impls.split(","), sizes, args.ops, args.iters, args.devices)
  columns = args.impls.split(",")
  if gpu_count() >= 2 and not args.no_flag_columns:
    # Columns that need other XLA flags, each measured in a child process.
    for suffix, impls, flag in [("_oneshot", ["psum"], ONESHOT_FLAG),
                                ("_no_graphs", ["b12x", "floor"], NO_GRAPHS)]:
      env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flag).strip())
      child = subprocess.run([sys.executable, __file__, "--child", "--impls", ",".join(impls), "--ops",
                              str(args.ops), "--iters", str(args.iters), "--devices", str(args.devices),
                              "--sizes", args.sizes], env=env, capture_output=True, text=True)
      line = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
      if not line:
        print(f"{impls}{suffix} failed:", child.stderr[-2000:])
        continue
      for size, row in json.loads(line[0][7:]).items():
        for impl in impls:
          results[size][impl + suffix] = row[impl]
      columns += [impl + suffix for impl in impls]
  print(f"\nall_reduce, bf16, {args.devices} devices, {args.ops} chained ops per executable, median of "
        f"{args.iters} runs, us per op")
  print("| size | " + " | ".join(columns) + " | psum / b12x |")
  print("|---|" + "---|" * (len(columns) + 1))
  for size in sizes:
    row = results[str(size)]
    cells = [f"{row[c]['us']:.1f}" + (" (psum path)" if c.startswith("b12x") and row[c]["path"] == "psum" else
                                      " (ffi kernel)" if c.endswith("_triton") and row[c].get("kernel") == "ffi"
                                      else "") for c in columns]
    speedup = row["psum"]["us"] / row["b12x"]["us"] if "b12x" in row and "psum" in row else float("nan")
    print(f"| {size_label(size)} | " + " | ".join(cells) + f" | {speedup:.2f}x |")
  big = [s for s in sizes if s >= 1 << 20]
  if big:
    n = args.devices
    print("\nbus bandwidth, GB/s (2(N-1)/N * size / time)" +
          (f"; GPU0 -> GPU1 peer copy: {peer_copy_gbps():.0f} GB/s" if gpu_count() >= 2 else ""))
    print("| size | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for size in big:
      row = results[str(size)]
      print(f"| {size_label(size)} | " +
            " | ".join(f"{2 * (n - 1) / n * size / row[c]['us'] / 1e3:.0f}" for c in columns) + " |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
