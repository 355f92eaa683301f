"""What a step with b12x calls costs when Python dispatches it once per token,
as serving loops do, beside the same step with psum and with no collective.

One device, through loopback (docs/DESIGN.md, "Loopback"): a mesh axis of one
device runs the whole b12x protocol, while psum over it is a no-op, so the
columns differ by what a b12x call costs on the dispatch path and on the
device. Each step is jitted once and dispatched ``--steps`` times back to
back, each step's output the next one's input, then blocked on once; per
step: ``total`` (the whole run) and ``dispatch`` (the Python loop alone). A
host that runs ahead of the device ends the loop well before the total.

Steps:
- tiny: one elementwise op on 16 KiB of float32 and 1, 8 or 64 chained
  calls (host-bound: the dispatch loop is the step);
- matmul: 4 chained bfloat16 matmuls (4096^2 on a GPU, 512^2 float32 on
  CPU) and 1 call (device-bound).
Before timing, every variant's result is checked: a loopback call returns
its input bit for bit, so every column ends on the same values.

Targets (on one GPU; a step where all_reduce stands for psum must dispatch as psum's does): the tiny step with 1 call dispatches in at
most 1.1x psum's time + 5 us; on the matmul step the dispatch loop ends at
least 5% before the total, and the total is at most psum's plus the calls'
own device time (the per-op time of 64 chained calls, measured here) plus 5%.

  python benchmarks/dispatch.py [--steps 300] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import gpu_count, per_op_us
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from loopback_kernels import chained

import b12x_jax

TINY_ELEMS = 4096  # 16 KiB of float32
MATMULS = 4


def step_fn(mesh, collective: str, calls: int, matmul: bool):
  """The jitted step: (matmuls, or one elementwise op), then ``calls``
  chained collectives of the first row's 4096 words, added back."""
  def body(x, w):
    if matmul:
      for _ in range(MATMULS):
        x = (x @ w) * 0.5 + 1
      y = x[:1, :TINY_ELEMS].astype(jnp.float32)
    else:
      y = x = x * 0.5 + 1
    for _ in range(calls if collective != "none" else 0):
      y = b12x_jax.all_reduce(y, "x") if collective == "b12x" else jax.lax.psum(y, "x")
    if matmul:
      return x.at[:1, :TINY_ELEMS].set(y.astype(x.dtype))
    return y
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))


def timed(fn, x, w, steps: int, repeats: int) -> tuple[float, float, object]:
  """(total, dispatch loop) us per step, the medians over ``repeats`` runs
  of ``steps`` back-to-back dispatches, and the last output."""
  for _ in range(10):
    x = fn(x, w)
  jax.block_until_ready(x)
  runs = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(steps):
      x = fn(x, w)
    dispatched = time.perf_counter()
    jax.block_until_ready(x)
    end = time.perf_counter()
    runs.append(((end - start) / steps * 1e6, (dispatched - start) / steps * 1e6))
  totals, loops = zip(*runs)
  return float(np.median(totals)), float(np.median(loops)), x


def call_device_us(mesh, elems: int, iters: int) -> float:
  """The device time of one b12x call of ``elems`` float32 words: per-op
  time of 64 chained calls in one executable (benchmarks/_common.py)."""
  ops = 64
  fn = chained(mesh, ops)
  y = jax.device_put(np.ones(elems, np.float32), NamedSharding(mesh, P("x")))
  return per_op_us(lambda: fn(y), ops, iters)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=int, default=300, help="steps dispatched back to back per run")
  parser.add_argument("--repeats", type=int, default=3, help="runs per cell (the median is reported)")
  parser.add_argument("--calls", type=int, nargs="+", default=[1, 8, 64], help="calls per tiny step")
  parser.add_argument("--matmul-size", type=int, help="matmul edge (default 4096 on a GPU, 512 on CPU)")
  parser.add_argument("--json", help="write the results here too")
  args = parser.parse_args()

  on_gpu = gpu_count() > 0
  mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
  size = args.matmul_size or (4096 if on_gpu else 512)
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  kinds = ("ffi", "triton") if on_gpu else ("ffi",)
  columns = ["none", "psum", *(f"b12x {k}" for k in kinds)]
  steps = [("tiny", c, False) for c in args.calls] + [("matmul", 1, True)]
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
  inputs = {False: (put(np.linspace(-1, 1, TINY_ELEMS, dtype=np.float32), P("x")), put(np.float32(0), P())),
            True: (put(jnp.ones((size, size), dtype), P("x")), put(jnp.eye(size, dtype=dtype), P()))}

  results: dict[tuple[str, int], dict[str, tuple[float, float]]] = {}
  device_us: dict[str, float] = {}
  first_out: dict[tuple[str, int], np.ndarray] = {}
  for column in columns:
    collective, _, kernels = column.partition(" ")
    comm = b12x_jax.Communicator(loopback=True, kernels=kernels or "ffi")
    b12x_jax.get_communicator().close()
    b12x_jax.set_communicator(comm)
    with b12x_jax.channel("dispatch"):
      for name, calls, matmul in steps:
        fn = step_fn(mesh, collective, calls, matmul)
        total, loop, out = timed(fn, *inputs[matmul], args.steps, args.repeats)
        results.setdefault((name, calls), {})[column] = (total, loop)
        reference = first_out.setdefault((name, calls), np.asarray(out))
        if not np.array_equal(np.asarray(out), reference):  # loopback calls return their input
          raise SystemExit(f"dispatch.py: {column} on the {name} step ({calls} calls) ended on other values "
                           f"than the step without a collective")
      if collective == "b12x":
        device_us[column] = call_device_us(mesh, TINY_ELEMS, 20)
        assert all(d.path == "b12x" for d in comm.decisions), comm.decisions[-1]
    comm.check_errors()
    comm.close()

  device = jax.devices()[0].device_kind
  print(f"jax {jax.__version__}, {device}, loopback, {args.steps} steps back to back, median of {args.repeats}; "
        f"us per step, total / dispatch loop")
  print(f"{'step':>18} " + " ".join(f"{c:>19}" for c in columns))
  for (name, calls), row in results.items():
    label = f"{name} ({calls} call{'s' if calls > 1 else ''})"
    print(f"{label:>18} " + " ".join(f"{row[c][0]:8.1f} / {row[c][1]:8.1f}" for c in columns))
  print("device time of one call (64 chained, per op): " +
        ", ".join(f"{c} {t:.2f} us" for c, t in device_us.items()))

  tiny, heavy = results[("tiny", 1)] if ("tiny", 1) in results else None, results[("matmul", 1)]
  for column in columns[2:]:
    verdicts = []
    if tiny is not None:
      bound = 1.1 * tiny["psum"][1] + 5
      verdicts.append(f"host cost {tiny[column][1]:.1f} <= {bound:.1f} us: "
                      f"{'met' if tiny[column][1] <= bound else 'MISSED'}")
    ahead = heavy[column][1] <= 0.95 * heavy[column][0]
    verdicts.append(f"run-ahead (loop {heavy[column][1]:.1f} <= 0.95 x total {heavy[column][0]:.1f}): "
                    f"{'met' if ahead else 'MISSED'}")
    bound = (heavy["psum"][0] + device_us[column]) * 1.05
    verdicts.append(f"total {heavy[column][0]:.1f} <= {bound:.1f} us: {'met' if heavy[column][0] <= bound else 'MISSED'}")
    print(f"{column}: " + "; ".join(verdicts))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": device, "jax": jax.__version__, "device_us": device_us,
                 "steps": {f"{n}/{c}": row for (n, c), row in results.items()}}, f, indent=1)


if __name__ == "__main__":
  main()
