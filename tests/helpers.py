"""Shared test helpers: float64 references and sharded inputs."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

DTYPES = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16, "float16": np.float16}
# Tolerance of one final rounding of an fp32 sum, relative to the magnitudes summed.
RTOL = {"float32": 1e-6, "bfloat16": 8e-3, "float16": 1e-3}


def random_shards(rng: np.random.Generator, n: int, elems: int, dtype) -> np.ndarray:
  """n fresh random shards of ``elems`` elements each (never zeros)."""
  return rng.standard_normal((n, elems)).astype(np.float32).astype(dtype)


def put_sharded(mesh, host: np.ndarray, axis: str = "x"):
  """Rows of ``host`` onto the devices of ``mesh`` along ``axis``."""
  return jax.device_put(host.reshape((-1,) + host.shape[2:]) if host.ndim > 2 else host.reshape(-1),
                        NamedSharding(mesh, P(axis)))


def assert_sum_matches(got_per_rank: np.ndarray, shards: np.ndarray, dtype_name: str, roundings: int = 1) -> None:
  """Every rank's result equals the float64 sum of the shards within
  ``roundings`` roundings (1 for b12x: fp32 accumulation; psum may round at
  every step), and all ranks hold identical bits."""
  want = shards.astype(np.float64).sum(axis=0)
  scale = np.abs(shards.astype(np.float64)).sum(axis=0) + 1e-30
  for r, got in enumerate(got_per_rank):
    err = np.abs(got.astype(np.float64) - want) / scale
    assert np.all(np.isfinite(got.astype(np.float64))), f"rank {r}: non-finite output"
    assert err.max() <= RTOL[dtype_name] * roundings, f"rank {r}: max relative error {err.max()} > {RTOL[dtype_name]}"
  first = got_per_rank[0].view(np.uint8)
  for r, got in enumerate(got_per_rank[1:], start=1):
    assert np.array_equal(first, got.view(np.uint8)), f"rank {r} differs from rank 0 in bits"
