"""What the benchmarks here share: per-op time of an executable of chained
collectives, measured one way for every column and every script; the GPU
count; size labels."""

from __future__ import annotations

import time
from collections.abc import Callable

# Runs before timing: the first compiles, the rest let the clocks ramp up.
WARMUP = 5


def per_op_us(run: Callable[[], object], ops: int, iters: int) -> float:
  """Median wall time of ``run()`` (one executable of ``ops`` chained ops;
  blocked on) over ``iters`` runs after WARMUP runs, per op, in us."""
  import jax
  import numpy as np
  for _ in range(WARMUP):
    jax.block_until_ready(run())
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - start)
  return float(np.median(times)) / ops * 1e6


def size_label(size: int) -> str:
  return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def gpu_count() -> int:
  import jax
  try:
    return len(jax.devices("gpu"))
  except RuntimeError:
    return 0
