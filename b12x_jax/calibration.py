"""Calibration of the all-reduce crossovers (b12x_jax.tuning): times
one-shot, two-shot and psum on this machine and stores where they take
over, for ``tuning.crossover_for`` to read. Beside the op's import graph,
not inside it: it imports the op it measures, which imports only tuning's
lookup. Also the one timing method of every benchmark (``per_op_us``, and
``paired_per_op_us`` for executables compared with each other)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence

from b12x_jax.tuning import Crossover, cache_path, stored_table, table_key


def per_op_us(run: Callable[[], object], ops: int, iters: int, warmup: int = 5, warmup_s: float = 0.2) -> float:
  """Median wall time of ``run()`` (one executable of ``ops`` chained ops;
  blocked on) over ``iters`` runs, per op, in us, after at least ``warmup``
  runs and ``warmup_s`` seconds of them (so the timed runs do not start on
  a GPU that just sat idle through a compile). The one timing method of
  calibration and of every benchmark: paired_per_op_us of one run."""
  return paired_per_op_us({"run": run}, ops, iters, warmup, warmup_s)["run"]


def paired_per_op_us(runs: dict[str, Callable[[], object]], ops: int, iters: int, warmup: int = 5,
                     warmup_s: float = 0.2) -> dict[str, float]:
  """per_op_us of several executables timed in turn (warmed up together,
  as per_op_us warms one): each of ``iters``
  rounds times one run of every one, so a change of the GPU's clocks
  between rounds falls on all of them alike, where timings taken one after
  the other (seconds apart) differ by it. Returns each one's median per op
  under its name, and, for the first name ``b`` and each other ``a``, the
  median of their per-round differences under ``"a - b"`` (a paired
  difference: steadier than the difference of two medians).

  In a program of several processes the warm-up is ``warmup`` rounds, not
  also ``warmup_s``: each process would count the rounds of a time by its
  own clock, and a collective run more often in one process than in
  another waits for peers that never come."""
  import jax
  import numpy as np
  warm_until, warmed = time.perf_counter() + (warmup_s if jax.process_count() == 1 else 0.0), 0
  while warmed < warmup or time.perf_counter() < warm_until:
    for run in runs.values():
      jax.block_until_ready(run())
    warmed += 1
  times: dict[str, list[float]] = {name: [] for name in runs}
  for _ in range(iters):
    for name, run in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(run())
      times[name].append((time.perf_counter() - start) / ops * 1e6)
  base, *others = runs
  out = {name: float(np.median(t)) for name, t in times.items()}
  out.update({f"{name} - {base}": float(np.median(np.subtract(times[name], times[base]))) for name in others})
  return out


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

  from b12x_jax.channels import channel
  from b12x_jax.communicator import Communicator, get_communicator, set_communicator
  from b12x_jax.ops.all_reduce import all_reduce

  world = mesh.shape[axis_name]
  capacity = max(sizes)
  times: dict[int, dict[str, float]] = {size: {} for size in sizes}
  for algorithm in ("one_shot", "two_shot", "psum"):
    get_communicator().close()
    set_communicator(Communicator(capacity_bytes=capacity, algorithm=algorithm if algorithm != "psum" else "one_shot",
                                  policy="psum" if algorithm == "psum" else "strict"))

    def body(x):
      for _ in range(ops):
        x = all_reduce(x, axis_name)
      return x

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis_name), out_specs=P(axis_name), check_vma=False))
    for size in sizes:
      x = jax.device_put(jnp.full((world * size // 2,), 1e-3, jnp.bfloat16), NamedSharding(mesh, P(axis_name)))
      with channel("b12x-calibration"):
        times[size][algorithm] = per_op_us(lambda: fn(x), ops, iters)
  get_communicator().close()
  set_communicator(Communicator())
  two_shot_from, psum_from = crossovers_from(times)
  device_kind = mesh.devices.flat[0].device_kind
  crossover = Crossover(two_shot_from, psum_from, f"calibrated ({cache_path()})")
  if store:
    path = cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    table = dict(stored_table())
    table[table_key(device_kind, world)] = {"two_shot_from": two_shot_from, "psum_from": psum_from,
                                       "times_us": {str(s): t for s, t in times.items()}}
    with open(path + ".tmp", "w") as f:
      json.dump(table, f, indent=1)
    os.replace(path + ".tmp", path)
  return crossover, times
