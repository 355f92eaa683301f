"""Per-op time of the DCP merge: dcp_a2a vs its two plain-JAX baselines, in one run.

Columns:
  b12x        b12x_jax.dcp_a2a (return_lse=True)
  all_to_all  jax.lax.all_to_all of out and lse, then the merge in jnp (the
              fallback path of dcp_a2a, taken here with policy "psum")
  ag_rs       jax.lax.all_gather of lse, each rank rescales its own partial
              out, then jax.lax.psum_scatter over the heads

Each measurement is one executable of `--ops` chained merges: each op's
inputs are the previous op's results tiled back over the heads ([B, H/N, D]
-> [B, H, D], one small fusion that every column pays), because independent
collectives in one program get combined by XLA and time as nothing. The
table shows the median per op over `--iters` runs, bf16 out, fp32 lse.

  python benchmarks/dcp_a2a.py            # needs 2 GPUs
  python benchmarks/dcp_a2a.py --smoke    # a tiny size on emulated CPU devices
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

from _common import add_timing_arguments, gpu_count, per_op_us

BATCHES = [1, 8, 64, 256]
HEADS = [32, 128]
DIMS = [128, 512]
IMPLS = ["b12x", "all_to_all", "ag_rs"]
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Emulated CPU devices for --smoke (no effect on GPU runs).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def ag_rs_merge(out, lse, axis_name: str):
  """The merge with all_gather(lse) + psum_scatter: every rank weighs its own
  partial out for all heads, then the weighted outs are summed and scattered
  by head shard. Same semantics as dcp_a2a (non-finite lse: weight 0)."""
  import jax
  import jax.numpy as jnp

  lses = jax.lax.all_gather(lse, axis_name)  # [N, B, H]
  finite = jnp.isfinite(lses)
  m = jnp.max(jnp.where(finite, lses, -jnp.inf), axis=0)
  anchor = jnp.where(jnp.isfinite(m), m, 0.0)
  weights = jnp.where(finite, jnp.exp(jnp.where(finite, lses, anchor) - anchor), 0.0)
  total = weights.sum(0)
  own = weights[jax.lax.axis_index(axis_name)]
  scale = jnp.where(total > 0, own / jnp.where(total > 0, total, 1.0), 0.0)
  weighted = jnp.where(scale[..., None] > 0, scale[..., None] * out.astype(jnp.float32), 0.0).astype(out.dtype)
  merged = jax.lax.psum_scatter(weighted, axis_name, scatter_dimension=1, tiled=True)
  merged_lse = jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
  shard = lse.shape[1] // jax.lax.axis_size(axis_name)
  return merged, jax.lax.dynamic_slice_in_dim(merged_lse, jax.lax.axis_index(axis_name) * shard, shard, axis=1)


def measure(shapes: list[tuple[int, int, int]], ops: int, iters: int, devices: int, platform: str) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax

  mesh = jax.make_mesh((devices,), ("x",), devices=jax.devices(platform)[:devices])
  comm = b12x_jax.get_communicator()
  merges = {"b12x": lambda o, l: b12x_jax.dcp_a2a(o, l, "x", return_lse=True),
            "all_to_all": lambda o, l: b12x_jax.dcp_a2a(o, l, "x", return_lse=True),
            "ag_rs": lambda o, l: ag_rs_merge(o, l, "x")}
  results: dict = {}
  for impl in IMPLS:
    def body(out, lse, merge=merges[impl]):
      for _ in range(ops):
        merged, merged_lse = merge(out, lse)
        out, lse = jnp.tile(merged, (1, devices, 1)), jnp.tile(merged_lse, (1, devices))
      return out, lse

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x")),
                               check_vma=False))
    for batch, heads, dim in shapes:
      rng = np.random.default_rng(0)
      out = jax.device_put(jnp.asarray(rng.standard_normal((devices * batch, heads, dim)), jnp.bfloat16),
                           NamedSharding(mesh, P("x")))
      lse = jax.device_put(jnp.asarray(rng.standard_normal((devices * batch, heads)), jnp.float32),
                           NamedSharding(mesh, P("x")))
      comm.policy = "psum" if impl == "all_to_all" else "auto"  # decided at trace time
      try:
        with b12x_jax.channel("bench"):
          us = per_op_us(lambda: fn(out, lse), ops, iters)
      finally:
        comm.policy = "auto"
      path = comm.decisions[-1].path if impl != "ag_rs" else "ag_rs"
      key = f"{batch}x{heads}x{dim}"
      results.setdefault(key, {})[impl] = {"us": us, "path": path}
  b12x_jax.check_errors()
  return results


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  add_timing_arguments(parser)
  parser.add_argument("--smoke", action="store_true", help="one tiny size on emulated CPU devices")
  args = parser.parse_args()
  if args.smoke:
    shapes, platform, args.ops, args.iters = [(1, 8, 128)], "cpu", 4, 3
  elif gpu_count() >= args.devices:
    shapes, platform = list(itertools.product(BATCHES, HEADS, DIMS)), "gpu"
  else:
    raise SystemExit(f"benchmarks/dcp_a2a.py needs {args.devices} GPUs (found {gpu_count()}); --smoke runs on CPU")
  results = measure(shapes, args.ops, args.iters, args.devices, platform)
  print(f"\ndcp_a2a, bf16 out, fp32 lse, {args.devices} devices on {platform}, {args.ops} chained merges per "
        f"executable, median of {args.iters} runs, us per op")
  print("| B | H | D | out bytes per rank | " + " | ".join(IMPLS) + " | all_to_all / b12x |")
  print("|---|---|---|---|" + "---|" * (len(IMPLS) + 1))
  for batch, heads, dim in shapes:
    row = results[f"{batch}x{heads}x{dim}"]
    cells = [f"{row[c]['us']:.1f}" + (" (fallback)" if c == "b12x" and row[c]["path"] != "b12x" else "")
             for c in IMPLS]
    speedup = row["all_to_all"]["us"] / row["b12x"]["us"]
    size = batch * heads * dim * 2
    print(f"| {batch} | {heads} | {dim} | {size >> 10} KiB | " + " | ".join(cells) + f" | {speedup:.2f}x |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
