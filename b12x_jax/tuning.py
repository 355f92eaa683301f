"""Which all-reduce algorithm a payload takes: one-shot, two-shot or psum.

Above the Lamport window (small payloads always take it), the CUDA
all-reduce runs one-shot (every rank reduces the whole payload: N-1 payloads
cross the links per rank) or two-shot (reduce-scatter then all-gather: each
rank reduces 1/N and 2(N-1)/N of the payload crosses), and psum may still
win somewhere. The crossovers are measured: ``calibrate`` times the three on
the machine once and stores them; ``crossover_for`` looks them up (the
stored calibration, else the measured defaults below, else one-shot always).

Every rank of a channel must pick the same algorithm (the kernels stage
differently): in one process one trace decides for all ranks; with several
processes only the packaged table (DEFAULTS) is used, never a stored file,
which could differ between processes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable, Sequence

# Where calibrations are stored: $B12X_JAX_CACHE, else ~/.cache/b12x_jax.
CACHE_ENV = "B12X_JAX_CACHE"
_FILE = "crossovers.json"


@dataclasses.dataclass(frozen=True)
class Crossover:
  """Payload sizes (bytes) from which an algorithm takes over, for one
  device kind and world size; None: never."""
  two_shot_from: int | None = None
  psum_from: int | None = None
  source: str = "none: one-shot at every size"


# Measured on this project's machines (benchmarks/RESULTS.md, 2026-11-29);
# keyed by (jax device_kind, world size). 2x H200: two-shot beat one-shot
# from 8 MiB in one run and from 32 MiB in another (they tie at 16 MiB);
# psum beat both only at 64 MiB in one of two runs, by 2%: not taken.
DEFAULTS: dict[tuple[str, int], Crossover] = {
    ("NVIDIA H200", 2): Crossover(two_shot_from=16 << 20, psum_from=None,
                                  source="measured default for 2x NVIDIA H200"),
}


def cache_path() -> str:
  root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "b12x_jax")
  return os.path.join(root, _FILE)


def _key(device_kind: str, world: int) -> str:
  return f"{device_kind}/{world}"


def crossover_for(device_kind: str, world: int, *, stored: bool = True) -> Crossover:
  """The stored calibration for (device_kind, world) (unless ``stored`` is
  False), else the measured default, else one-shot everywhere (psum only
  beyond capacity_bytes)."""
  calibrated = _stored_table().get(_key(device_kind, world)) if stored else None
  if calibrated is not None:
    return Crossover(calibrated.get("two_shot_from"), calibrated.get("psum_from"), f"calibrated ({cache_path()})")
  return DEFAULTS.get((device_kind, world), Crossover())


def _stored_table() -> dict:
  """The stored calibrations; read again only when the file changes (every
  traced all_reduce above the Lamport window asks)."""
  path = cache_path()
  try:
    return _read_table(path, os.stat(path).st_mtime_ns)
  except OSError:
    return {}


@functools.lru_cache(maxsize=4)
def _read_table(path: str, mtime_ns: int) -> dict:
  del mtime_ns  # part of the cache key only
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def per_op_us(run: Callable[[], object], ops: int, iters: int, warmup: int = 5, warmup_s: float = 0.2) -> float:
  """Median wall time of ``run()`` (one executable of ``ops`` chained ops;
  blocked on) over ``iters`` runs, per op, in us, after at least ``warmup``
  runs and ``warmup_s`` seconds of them (so the timed runs do not start on
  a GPU that just sat idle through a compile). The one timing method of
  calibration and of every benchmark."""
  import jax
  import numpy as np
  warm_until, warmed = time.perf_counter() + warmup_s, 0
  while warmed < warmup or time.perf_counter() < warm_until:
    jax.block_until_ready(run())
    warmed += 1
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - start)
  return float(np.median(times)) / ops * 1e6


def crossovers_from(times: dict[int, dict[str, float]]) -> tuple[int | None, int | None]:
  """(two_shot_from, psum_from) from per-size times {"one_shot", "two_shot",
  "psum"}: the smallest measured size from which the challenger wins at
  that size and every larger one (a win that does not last is noise)."""
  sizes = sorted(times)

  def takes_over(faster: Callable[[dict[str, float]], bool]) -> int | None:
    start = None
    for size in sizes:
      if faster(times[size]):
        start = size if start is None else start
      else:
        start = None
    return start

  two_shot_from = takes_over(lambda t: t["two_shot"] < t["one_shot"])
  psum_from = takes_over(lambda t: t["psum"] < min(t["one_shot"], t["two_shot"]))
  return two_shot_from, psum_from


def calibrate(mesh, axis_name: str, sizes: Sequence[int] = tuple(1 << k for k in range(21, 26)), *, ops: int = 16,
              iters: int = 10, store: bool = True) -> tuple[Crossover, dict[int, dict[str, float]]]:
  """Times one-shot, two-shot and psum (bf16, ``ops`` chained calls) at
  ``sizes`` on the devices of ``mesh`` along ``axis_name``, derives the
  crossovers, and (``store``) writes them where ``crossover_for`` reads
  them. Runs on fresh communicators with capacity for the largest size and
  leaves a default one installed. Returns (crossover, times in us per op)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  from b12x_jax.ops.all_reduce import all_reduce

  world = mesh.shape[axis_name]
  capacity = max(sizes)
  times: dict[int, dict[str, float]] = {size: {} for size in sizes}
  for algorithm in ("one_shot", "two_shot", "psum"):
    b12x_jax.get_communicator().close()
    b12x_jax.set_communicator(b12x_jax.Communicator(capacity_bytes=capacity, algorithm=algorithm
                                                    if algorithm != "psum" else "one_shot",
                                                    policy="psum" if algorithm == "psum" else "strict"))

    def body(x):
      for _ in range(ops):
        x = all_reduce(x, axis_name)
      return x

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis_name), out_specs=P(axis_name), check_vma=False))
    for size in sizes:
      x = jax.device_put(jnp.full((world * size // 2,), 1e-3, jnp.bfloat16), NamedSharding(mesh, P(axis_name)))
      with b12x_jax.channel("b12x-calibration"):
        times[size][algorithm] = per_op_us(lambda: fn(x), ops, iters)
  b12x_jax.get_communicator().close()
  b12x_jax.set_communicator(b12x_jax.Communicator())
  two_shot_from, psum_from = crossovers_from(times)
  device_kind = mesh.devices.flat[0].device_kind
  crossover = Crossover(two_shot_from, psum_from, f"calibrated ({cache_path()})")
  if store:
    path = cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    table = dict(_stored_table())
    table[_key(device_kind, world)] = {"two_shot_from": two_shot_from, "psum_from": psum_from,
                                       "times_us": {str(s): t for s, t in times.items()}}
    with open(path + ".tmp", "w") as f:
      json.dump(table, f, indent=1)
    os.replace(path + ".tmp", path)
  return crossover, times
