"""Per-op time of all_reduce_residual_rmsnorm vs the unfused sequence, in one run.

The decode step after a row-parallel layer: all-reduce the partial sums, add
the residual, RMSNorm. Each measurement is one executable of `--ops` chained
steps (the next step's input is this step's normed output), timed like every
benchmark here (_common.per_op_us). Columns:
  fused     b12x_jax.all_reduce_residual_rmsnorm (one kernel on CUDA)
  unfused   b12x_jax.all_reduce, then the add and RMSNorm in jnp (XLA fuses them)
  fused_triton, unfused_triton   the same with Communicator(kernels="triton"):
            the Pallas Triton kernels (a cell marked "ffi kernel" where the
            call fell back)
  psum      jax.lax.psum, then the same jnp

  python benchmarks/residual_rmsnorm.py      # GPUs if >= 2, else CPU devices
"""

from __future__ import annotations

import argparse
import json
import os

from _common import add_and_norm, add_timing_arguments, gpu_count, per_op_us

SHAPES = [(1, 4096), (8, 4096), (16, 4096), (64, 4096), (1, 8192), (8, 8192), (16, 8192), (64, 8192)]
EPS = 1e-6
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def _step(impl: str):
  import jax

  import b12x_jax
  impl = impl.removesuffix("_triton")
  if impl == "fused":
    return lambda x, res, w: b12x_jax.all_reduce_residual_rmsnorm(x, res, w, "x", eps=EPS)
  if impl == "unfused":
    return lambda x, res, w: add_and_norm(b12x_jax.all_reduce(x, "x"), res, w, EPS)
  if impl == "psum":
    return lambda x, res, w: add_and_norm(jax.lax.psum(x, "x"), res, w, EPS)
  raise ValueError(f"unknown impl {impl!r}")


def measure(impls: list[str], shapes: list[tuple[int, int]], ops: int, iters: int, devices: int) -> dict:
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax

  platform = "gpu" if gpu_count() >= 2 else "cpu"
  mesh = jax.make_mesh((devices,), ("x",), devices=jax.devices(platform)[:devices])
  results: dict = {}
  for impl in impls:
    step = _step(impl)
    kernels = "triton" if impl.endswith("_triton") else "ffi"
    if b12x_jax.get_communicator().kernels != kernels:
      b12x_jax.get_communicator().close()
      b12x_jax.set_communicator(b12x_jax.Communicator(kernels=kernels))

    def body(x, res, w, step=step):
      for _ in range(ops):
        x, res = step(x, res, w)
      return x, res

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=(P("x"), P()),
                               check_vma=False))
    for rows, hidden in shapes:
      x = jax.device_put(jnp.ones((devices * rows, hidden), jnp.bfloat16) * 1e-2, NamedSharding(mesh, P("x")))
      res = jnp.zeros((rows, hidden), jnp.bfloat16)
      w = jnp.ones((hidden,), jnp.bfloat16)
      with b12x_jax.channel("bench"):
        us = per_op_us(lambda: fn(x, res, w), ops, iters)
      decisions = b12x_jax.get_communicator().decisions
      last = decisions[-1] if impl != "psum" and decisions else None
      results.setdefault(f"{rows}x{hidden}", {})[impl] = {"us": us, "path": last.path if last else impl,
                                                          "kernel": last.kernel if last else None}
  b12x_jax.check_errors()
  return results


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  add_timing_arguments(parser)
  parser.add_argument("--shapes", default=",".join(f"{r}x{h}" for r, h in SHAPES), help="ROWSxHIDDEN,...")
  parser.add_argument("--impls", default=None, help="columns, comma-separated; when not given, "
                      "fused,unfused,fused_triton,unfused_triton,psum on GPUs, fused,unfused,psum on CPU")
  args = parser.parse_args()
  shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
  impls = (args.impls or ("fused,unfused,fused_triton,unfused_triton,psum" if gpu_count() >= 2 else
                          "fused,unfused,psum")).split(",")
  ratio_columns = [("unfused", "fused"), ("psum", "fused"), ("unfused_triton", "fused_triton")]
  ratio_columns = [(a, b) for a, b in ratio_columns if a in impls and b in impls]
  results = measure(impls, shapes, args.ops, args.iters, args.devices)
  print(f"\nall_reduce + residual add + RMSNorm, bf16, {args.devices} devices, {args.ops} chained steps per "
        f"executable, median of {args.iters} runs, us per step")
  print("| rows x hidden | " + " | ".join(impls) + "".join(f" | {a} / {b}" for a, b in ratio_columns) + " |")
  print("|---|" + "---|" * (len(impls) + len(ratio_columns)))
  for rows, hidden in shapes:
    row = results[f"{rows}x{hidden}"]
    cells = [f"{row[c]['us']:.1f}" + ("" if row[c]["path"] in ("b12x", c) else f" ({row[c]['path']} path)") +
             (" (ffi kernel)" if c.endswith("_triton") and row[c]["kernel"] == "ffi" else "") for c in impls]
    ratios = [row[a]["us"] / row[b]["us"] for a, b in ratio_columns]
    print(f"| {rows} x {hidden} | " + " | ".join(cells) + "".join(f" | {r:.2f}x" for r in ratios) + " |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
