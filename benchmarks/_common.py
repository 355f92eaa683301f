"""What the benchmarks here share: per-op time of an executable of chained
collectives, measured one way for every column, every script and the
calibration (b12x_jax.tuning.per_op_us); the GPU count; size labels."""

from __future__ import annotations

from b12x_jax.tuning import per_op_us  # noqa: F401 - the one timing method, shared with calibration


def size_label(size: int) -> str:
  return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def gpu_count() -> int:
  import jax
  try:
    return len(jax.devices("gpu"))
  except RuntimeError:
    return 0
