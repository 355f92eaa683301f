"""Per-op time of all_reduce vs jax.lax.psum across processes: one device per
process, joined by jax.distributed on 127.0.0.1 (CUDA IPC on GPUs, shared
memory on CPU). The same chained-ops method as benchmarks/all_reduce.py:
each executable chains `--ops` collectives on the previous result; median
of `--iters` runs, us per op, printed by process 0.

  python benchmarks/all_reduce_multiprocess.py             # 2 processes, one GPU each if >= 2 GPUs
  python benchmarks/all_reduce_multiprocess.py --platform cpu --sizes 4096 --iters 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from _common import add_timing_arguments, per_op_us, size_label

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20, 32 << 20]


def worker(args) -> None:
  if args.platform == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  if args.platform == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.processes, process_id=args.process_id,
                             local_device_ids=[args.process_id] if args.platform == "gpu" else None)
  import b12x_jax

  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  ops = {"b12x": lambda x: b12x_jax.all_reduce(x, "x"), "psum": lambda x: jax.lax.psum(x, "x")}
  results: dict = {}
  for impl, op in ops.items():
    def body(x, op=op):
      for _ in range(args.ops):
        x = op(x)
      return x

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    for size in args.sizes:
      x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                                 np.full((size // 2,), 1e-3, jnp.bfloat16))
      with b12x_jax.channel("bench"):
        us = per_op_us(lambda: fn(x), args.ops, args.iters)
      path = b12x_jax.get_communicator().decisions[-1].path if impl == "b12x" else impl
      results.setdefault(str(size), {})[impl] = {"us": us, "path": path}
  b12x_jax.check_errors()
  b12x_jax.get_communicator().close()  # collective: before jax.distributed shuts down
  if jax.process_index() == 0:
    print("RESULT " + json.dumps(results), flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--processes", type=int, default=2, help="jax.distributed processes, one device each")
  parser.add_argument("--platform", choices=["gpu", "cpu"], default=None,
                      help="when not given, gpu if >= 2 GPUs, else cpu")
  add_timing_arguments(parser, devices=False)
  parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="payload bytes, comma-separated")
  parser.add_argument("--timeout", type=float, default=900, help="hard limit for the workers, seconds")
  parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  args.sizes = [int(s) for s in args.sizes.split(",")]
  if args.process_id is not None:
    worker(args)
    return
  args.platform = args.platform or ("gpu" if _gpus() >= 2 else "cpu")
  from b12x_jax.rendezvous import coordinator_port

  port = coordinator_port()
  base = [sys.executable, __file__, "--processes", str(args.processes), "--platform", args.platform, "--ops",
          str(args.ops), "--iters", str(args.iters), "--sizes", ",".join(map(str, args.sizes)), "--port", str(port)]
  procs = [subprocess.Popen(base + ["--process-id", str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for i in range(args.processes)]
  try:
    outputs = [p.communicate(timeout=args.timeout) for p in procs]
  finally:
    for p in procs:
      p.kill()
  line = [ln for ln in outputs[0][0].splitlines() if ln.startswith("RESULT ")]
  if not line or any(p.returncode for p in procs):
    sys.exit("workers failed:\n" + "\n".join(err[-2000:] for _, err in outputs))
  results = json.loads(line[0][len("RESULT "):])
  print(f"\nall_reduce across {args.processes} processes ({args.platform}, one device each), bf16, {args.ops} "
        f"chained ops per executable, median of {args.iters} runs, us per op")
  print("| size | b12x | psum | psum / b12x |\n|---|---|---|---|")
  for size in args.sizes:
    row = results[str(size)]
    note = " (psum path)" if row["b12x"]["path"] == "psum" else ""
    print(f"| {size_label(size)} | {row['b12x']['us']:.1f}{note} | {row['psum']['us']:.1f} | "
          f"{row['psum']['us'] / row['b12x']['us']:.2f}x |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


def _gpus() -> int:
  # Counted without jax: the launcher must not open the GPUs its workers use.
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return 0
  return len([ln for ln in out.splitlines() if ln.startswith("GPU ")])


if __name__ == "__main__":
  main()
