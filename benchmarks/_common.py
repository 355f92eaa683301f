"""What the benchmarks here share: per-op time of an executable of chained
collectives, measured one way for every column, every script and the
calibration (b12x_jax.calibration.per_op_us, paired_per_op_us); the GPU count;
size labels."""

from __future__ import annotations

from b12x_jax.calibration import paired_per_op_us, per_op_us  # noqa: F401 - shared with calibration


def add_timing_arguments(parser, devices: bool = True) -> None:
  """The options every benchmark takes: chained ops per executable, timed
  runs, devices in the mesh, and where to write the results as JSON."""
  parser.add_argument("--ops", type=int, default=64, help="chained collectives per executable")
  parser.add_argument("--iters", type=int, default=50, help="timed runs (the median is reported)")
  if devices:
    parser.add_argument("--devices", type=int, default=2, help="devices in the mesh")
  parser.add_argument("--json", help="write the results here too")


def size_label(size: int) -> str:
  return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def gpu_count() -> int:
  import jax
  try:
    return len(jax.devices("gpu"))
  except RuntimeError:
    return 0


def add_and_norm(total, residual, weight, eps: float = 1e-6):
  """What a user writes after an all-reduce instead of the fused op: the
  residual add, rounded, then RMSNorm of it (b12x_jax's unfused path)."""
  import jax
  import jax.numpy as jnp
  new_residual = (total.astype(jnp.float32) + residual.astype(jnp.float32)).astype(total.dtype)
  r = new_residual.astype(jnp.float32)
  normed = r * jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + eps) * weight.astype(jnp.float32)
  return normed.astype(total.dtype), new_residual
