"""Which all-reduce algorithm a payload takes: one-shot, two-shot or psum.

Above the Lamport window (small payloads always take it), the CUDA
all-reduce runs one-shot (every rank reduces the whole payload: N-1 payloads
cross the links per rank) or two-shot (reduce-scatter then all-gather: each
rank reduces 1/N and 2(N-1)/N of the payload crosses), and psum may still
win somewhere. The crossovers are measured: ``b12x_jax.calibration``
times the three on the machine once and stores them; ``crossover_for``
looks them up here (the stored calibration, else the measured defaults
below, else one-shot always). This module imports no op: the op that asks
it is what calibration measures.

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


def table_key(device_kind: str, world: int) -> str:
  return f"{device_kind}/{world}"


def crossover_for(device_kind: str, world: int, *, stored: bool = True) -> Crossover:
  """The stored calibration for (device_kind, world) (unless ``stored`` is
  False), else the measured default, else one-shot everywhere (psum only
  beyond capacity_bytes). A stored file or entry that is not what
  calibration writes is passed over, and the source says why."""
  default = DEFAULTS.get((device_kind, world), Crossover())
  if not stored:
    return default
  table, problem = _stored()
  where = cache_path()
  calibrated = table.get(table_key(device_kind, world))
  if problem is None and calibrated is not None:
    problem = _entry_problem(calibrated)
    where = f"{where}'s entry {table_key(device_kind, world)!r}"
  if problem is not None:
    return dataclasses.replace(default, source=f"{default.source}; passed over {where}: {problem} (run "
                               "b12x_jax.calibration again, or delete the file)")
  if calibrated is None:
    return default
  return Crossover(calibrated.get("two_shot_from"), calibrated.get("psum_from"), f"calibrated ({cache_path()})")


def _entry_problem(entry) -> str | None:
  """Why a stored entry is not one calibration writes, or None."""
  if not isinstance(entry, dict):
    return f"{entry!r} is not an object"
  for name in ("two_shot_from", "psum_from"):
    value = entry.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
      return f"{name} is {value!r}, not a byte count or null"
  return None


def stored_table() -> dict:
  """The stored calibrations (empty where none, or where the file is not
  what calibration writes); read again only when the file changes (every
  traced all_reduce above the Lamport window asks)."""
  return _stored()[0]


def _stored() -> tuple[dict, str | None]:
  """stored_table, and why the file was passed over (None where it was read
  or there is none)."""
  path = cache_path()
  try:
    return _read_table(path, os.stat(path).st_mtime_ns)
  except OSError:
    return {}, None


@functools.lru_cache(maxsize=4)
def _read_table(path: str, mtime_ns: int) -> tuple[dict, str | None]:
  del mtime_ns  # part of the cache key only
  try:
    with open(path) as f:
      table = json.load(f)
  except OSError as e:
    return {}, f"it cannot be read ({e.strerror})"
  except ValueError as e:
    return {}, f"it is not JSON ({e})"
  if not isinstance(table, dict):  # calibration writes an object
    return {}, f"it holds a JSON {type(table).__name__}, not an object"
  return table, None
