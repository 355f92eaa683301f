"""Per-op time of all_reduce vs jax.lax.psum, in one run.

Each measurement is one executable of `--ops` chained collectives (each
consumes the previous result: independent collectives get combined by XLA
and time as nothing), timed over `--iters` runs after warm-up; the table
shows the median per op. Columns (impls):
  b12x          all_reduce with the default Communicator (Lamport up to 1 MiB)
  b12x_barrier  all_reduce with the Lamport path off (lamport_bytes=0)
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
import subprocess
import sys

from _common import gpu_count, per_op_us, size_label

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20, 32 << 20]
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
      b12x_jax.set_communicator(b12x_jax.Communicator(**({"lamport_bytes": 0} if impl == "b12x_barrier" else {})))
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
      path = b12x_jax.get_communicator().decisions[-1].path if impl.startswith("b12x") else impl
      results.setdefault(str(size), {})[impl] = {"us": us, "path": path}
  b12x_jax.check_errors()
  return results


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
  parser = argparse.ArgumentParser()
  parser.add_argument("--ops", type=int, default=64)
  parser.add_argument("--iters", type=int, default=50)
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
  parser.add_argument("--impls", default=None, help="default: b12x,b12x_barrier,psum,floor on GPUs, b12x,psum on CPU")
  parser.add_argument("--json", help="write the results here too")
  parser.add_argument("--no-flag-columns", action="store_true", help="skip the columns measured in subprocesses")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  sizes = [int(s) for s in args.sizes.split(",")]
  args.impls = args.impls or ("b12x,b12x_barrier,psum,floor" if gpu_count() >= 2 else "b12x,psum")
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
    cells = [f"{row[c]['us']:.1f}" + (" (psum path)" if c.startswith("b12x") and row[c]["path"] == "psum" else "")
             for c in columns]
    speedup = row["psum"]["us"] / row["b12x"]["us"] if "b12x" in row and "psum" in row else float("nan")
    print(f"| {size_label(size)} | " + " | ".join(cells) + f" | {speedup:.2f}x |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
