"""Torture: random programs of collectives, every result checked.

From a seed, ``run_torture`` builds random programs: each one jitted
``jax.shard_map`` function over a 1-D mesh axis holding 1..7 collectives
(odd and even counts both occur), each an ``all_reduce`` (float32, bfloat16
or float16, 16 bytes to 2 MiB, some sizes not a multiple of 16 bytes: those
take the psum fallback) or a ``dcp_a2a`` (B 1..16, H a multiple of N, D 64 or
128, bfloat16 or float16, some empty KV shards, return_lse and lse_base
random). Each program is compiled for channel "target", "draft" or both, and
executions pick program and channel at random, so target and draft
executables interleave. Every collective gets fresh random inputs (never
zeros), and every result of every execution is checked against a float64
NumPy reference; the path each collective took (``decisions``) and every
rank's epoch at the end are checked too.

Shared by the CPU test (tests/test_torture.py) and the GPU worker
(tests/workers.py ``torture`` mode). A failure names the seed, the program,
the execution and the collective, so it reproduces with the same seed.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import b12x_jax
from helpers import DTYPES, assert_merge_matches, assert_sum_matches, attention_shards, random_shards

CHANNELS = ("target", "draft")
MAX_OPS = 7
MAX_BYTES = 2 << 20
PACK = 16  # the b12x window: payloads (all_reduce) and rows (dcp_a2a) a multiple of 16 bytes
# Sizes where paths change (CUDA: the 1 MiB Lamport window, the barrier path above it); drawn often.
EDGE_BYTES = (16, 32, 4096, (1 << 20) - 16, 1 << 20, (1 << 20) + 16, MAX_BYTES)


@dataclasses.dataclass(frozen=True)
class AllReduce:
  """One all_reduce of a per-rank array of ``shape`` in ``dtype_name``."""
  dtype_name: str
  shape: tuple[int, ...]

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * np.dtype(DTYPES[self.dtype_name]).itemsize

  def expected_path(self, capacity_bytes: int) -> str:
    return "b12x" if self.nbytes % PACK == 0 and self.nbytes <= capacity_bytes else "psum"

  def __str__(self) -> str:
    return f"all_reduce({self.dtype_name}{list(self.shape)}, {self.nbytes} B)"


@dataclasses.dataclass(frozen=True)
class DcpA2a:
  """One dcp_a2a of out [B, H, D] in ``dtype_name``; ``empty`` lists
  (shard, b, h) without keys, ``all_empty`` (b, h) without keys anywhere."""
  dtype_name: str
  batch: int
  heads: int
  dim: int
  return_lse: bool
  lse_base: str
  empty: tuple[tuple[int, int, int], ...]
  all_empty: tuple[tuple[int, int], ...]

  def expected_path(self, capacity_bytes: int) -> str:
    del capacity_bytes  # a few KiB per source at most: always inside the window
    return "b12x"

  def __str__(self) -> str:
    return (f"dcp_a2a({self.dtype_name}[{self.batch}, {self.heads}, {self.dim}], return_lse={self.return_lse}, "
            f"lse_base={self.lse_base!r}, empty={list(self.empty)}, all_empty={list(self.all_empty)})")


Op = AllReduce | DcpA2a


@dataclasses.dataclass
class Program:
  """A jitted shard_map function running ``ops`` in order on one channel
  per executable (``channels``); ``chained`` makes each op's input depend on
  the previous op's result (adding 0 times one of its elements);
  ``traced`` holds the channels it has an executable for."""
  index: int
  ops: list[Op]
  channels: tuple[str, ...]
  chained: bool
  fn: object = None
  traced: set = dataclasses.field(default_factory=set)

  def __str__(self) -> str:
    return f"program {self.index} ({'chained' if self.chained else 'independent'}): " + "; ".join(map(str, self.ops))


# -- building programs ---------------------------------------------------------------------------------------


def random_all_reduce(rng: np.random.Generator) -> AllReduce:
  """16 bytes to MAX_BYTES, log-uniform (edge sizes one time in five), a
  multiple of 16 bytes three times in four; 1 to 3 dims."""
  dtype_name = str(rng.choice(list(DTYPES)))
  itemsize = np.dtype(DTYPES[dtype_name]).itemsize
  if rng.random() < 0.2:
    nbytes = int(rng.choice(EDGE_BYTES))
  else:
    nbytes = PACK * int(np.exp(rng.uniform(0, np.log(MAX_BYTES // PACK))))
  elems = nbytes // itemsize
  if rng.random() < 0.25:  # off the 16-byte grid: the psum path
    elems += int(rng.integers(1, PACK // itemsize))
  return AllReduce(dtype_name, _random_shape(rng, elems))


def _random_shape(rng: np.random.Generator, elems: int) -> tuple[int, ...]:
  ndim = int(rng.integers(1, 4))
  shape = []
  for _ in range(ndim - 1):
    divisors = [d for d in (2, 3, 4, 8, 16) if elems % d == 0]
    if not divisors:
      break
    d = int(rng.choice(divisors))
    shape.append(d)
    elems //= d
  return tuple(shape[::-1]) + (elems,) if shape else (elems,)


def random_dcp_a2a(rng: np.random.Generator, n: int) -> DcpA2a:
  """B 1..16, H = N * (1..4), D 64 or 128; a few (shard, b, h) without keys
  (-inf lse, NaN payload) half the time, a (b, h) without any a quarter."""
  batch, heads, dim = int(rng.integers(1, 17)), n * int(rng.integers(1, 5)), int(rng.choice([64, 128]))
  empty: list[tuple[int, int, int]] = []
  if rng.random() < 0.5:
    for _ in range(int(rng.integers(1, 4))):
      empty.append((int(rng.integers(n)), int(rng.integers(batch)), int(rng.integers(heads))))
  all_empty = [(int(rng.integers(batch)), int(rng.integers(heads)))] if rng.random() < 0.25 else []
  return DcpA2a(str(rng.choice(["bfloat16", "float16"])), batch, heads, dim, bool(rng.random() < 0.5),
                str(rng.choice(["e", "2"])), tuple(empty), tuple(all_empty))


def random_programs(rng: np.random.Generator, n: int, count: int, channels=CHANNELS) -> list[Program]:
  """``count`` (>= 2) programs: the first holds an odd number of ops, the
  second an even one; the first runs on channels[0] only, the second on
  channels[-1] only, and the rest on one or both."""
  assert count >= 2, count
  programs = []
  for i in range(count):
    if i == 0:
      length = int(rng.choice([1, 3, 5, 7]))
    elif i == 1:
      length = int(rng.choice([2, 4, 6]))
    else:
      length = int(rng.integers(1, MAX_OPS + 1))
    ops = [random_dcp_a2a(rng, n) if rng.random() < 0.35 else random_all_reduce(rng) for _ in range(length)]
    if i < 2:
      chans = (channels[0],) if i == 0 else (channels[-1],)
    else:
      pick = int(rng.integers(3))
      chans = tuple(channels) if pick == 2 else (channels[pick % len(channels)],)
    programs.append(Program(i, ops, chans, chained=bool(rng.random() < 0.5)))
  return programs


def _body(ops: list[Op], axis: str, chained: bool):
  """The shard_map body: the inputs of every op, flat, in op order; returns
  their results, flat."""
  def body(*args):
    results, at, dep = [], 0, None
    for op in ops:
      if isinstance(op, AllReduce):
        (x,), at = args[at:at + 1], at + 1
        if dep is not None:
          x = x + dep.astype(x.dtype)
        y = b12x_jax.all_reduce(x, axis)
        results.append(y)
        first = y
      else:
        (out, lse), at = args[at:at + 2], at + 2
        if dep is not None:
          out = out + dep.astype(out.dtype)  # NaN payloads of empty rows stay NaN
        merged = b12x_jax.dcp_a2a(out, lse, axis, return_lse=op.return_lse, lse_base=op.lse_base)
        merged = merged if op.return_lse else (merged,)
        results.extend(merged)
        first = merged[0]  # finite everywhere (0 where no shard has a key)
      if chained:
        dep = 0 * first.reshape(-1)[0].astype(jnp.float32)
    return tuple(results)
  return body


# -- inputs and checks ---------------------------------------------------------------------------------------


def _inputs(rng: np.random.Generator, op: Op, n: int):
  """(host arrays to shard along the axis, what the check needs)."""
  if isinstance(op, AllReduce):
    shards = random_shards(rng, n, int(np.prod(op.shape)), DTYPES[op.dtype_name])
    return [shards.reshape((n * op.shape[0],) + op.shape[1:])], shards
  outs, lses, want, want_lse = attention_shards(rng, n, op.batch, op.heads, op.dim, DTYPES[op.dtype_name],
                                                base2=op.lse_base == "2", empty=op.empty, all_empty=op.all_empty)
  return [outs.reshape((n * op.batch,) + outs.shape[2:]), lses.reshape(n * op.batch, op.heads)], \
      (outs, want, want_lse)


def _check(op: Op, path: str, n: int, results: list, reference) -> None:
  if isinstance(op, AllReduce):
    got = np.asarray(results[0]).reshape(n, -1)
    assert_sum_matches(got, reference, op.dtype_name, roundings=1 if path == "b12x" else n)
    return
  outs, want, want_lse = reference
  got = np.asarray(results[0]).reshape(n, op.batch, op.heads // n, op.dim)
  got_lse = np.asarray(results[1]).reshape(n, op.batch, op.heads // n) if op.return_lse else None
  assert got.dtype == outs.dtype, got.dtype
  assert_merge_matches(got, got_lse, outs, want, want_lse, op.dtype_name)


def _outputs_of(op: Op) -> int:
  return 2 if isinstance(op, DcpA2a) and op.return_lse else 1


def _epoch(comm: b12x_jax.Communicator, channel: str, device) -> int:
  """``device``'s epoch on ``channel``; 0 where it is not prepared yet."""
  try:
    return comm.stats(channel, device)["epoch"]
  except b12x_jax.ChannelError:
    return 0


# -- the loop ------------------------------------------------------------------------------------------------


def run_torture(mesh, axis: str, *, seed: int, calls: int, programs: int = 8, channels=CHANNELS,
                in_flight: int | None = None, log=None) -> dict:
  """Runs random programs over ``axis`` of the 1-D ``mesh`` until at least
  ``calls`` collective calls were checked; returns ``dict(calls=...,
  runs=..., programs=..., ops=..., paths=...)`` (collective calls checked,
  executions, programs built, their collectives by kind, and by path).

  ``in_flight`` executions are dispatched before the oldest one is checked:
  default 0 on CPU (block after each: XLA:CPU with few cores can deadlock
  multi-device collectives queued asynchronously), 2 elsewhere. Every result
  is checked all the same. Raises AssertionError naming the seed, program,
  execution and collective at the first wrong result or epoch."""
  n = mesh.shape[axis]
  assert len(mesh.shape) == 1, "run_torture takes a 1-D mesh"
  platform = mesh.devices.flat[0].platform
  if in_flight is None:
    in_flight = 0 if platform == "cpu" else 2
  rng = np.random.default_rng([seed, n])
  comm = b12x_jax.get_communicator()
  sharding = NamedSharding(mesh, P(axis))
  built = random_programs(rng, n, programs, channels)
  for program in built:
    outputs = sum(_outputs_of(op) for op in program.ops)
    inputs = sum(2 if isinstance(op, DcpA2a) else 1 for op in program.ops)
    program.fn = jax.jit(jax.shard_map(_body(program.ops, axis, program.chained), mesh=mesh,
                                       in_specs=(P(axis),) * inputs, out_specs=(P(axis),) * outputs))
  base = {c: [_epoch(comm, c, d) for d in mesh.devices.flat] for c in channels}
  b12x_calls = collections.Counter()
  stats = {"calls": 0, "runs": 0, "programs": len(built), "ops": collections.Counter(), "paths": collections.Counter()}
  for program in built:
    for op in program.ops:
      stats["ops"][type(op).__name__] += 1
  pending: collections.deque = collections.deque()

  def check_oldest() -> None:
    run, program, channel, references, results = pending.popleft()
    where = f"torture seed={seed} n={n} run {run} on {channel!r}, {program}"
    at = 0
    for i, (op, reference) in enumerate(zip(program.ops, references)):
      path = op.expected_path(comm.capacity_bytes)
      k = _outputs_of(op)
      try:
        _check(op, path, n, list(results[at:at + k]), reference)
      except AssertionError as e:
        raise AssertionError(f"{where}: op {i} {op} ({path}): {e}") from None
      at += k
      stats["calls"] += 1
      stats["paths"][path] += 1

  run = 0
  while stats["calls"] + sum(len(p[1].ops) for p in pending) < calls:
    program = built[int(rng.integers(len(built)))] if run >= len(built) else built[run]  # each program once first
    channel = program.channels[int(rng.integers(len(program.channels)))]
    host, references = [], []
    for op in program.ops:
      arrays, reference = _inputs(rng, op, n)
      host += arrays
      references.append(reference)
    with b12x_jax.channel(channel):  # part of jit's cache key: one executable per (program, channel)
      results = program.fn(*[jax.device_put(a, sharding) for a in host])
    if channel not in program.traced:  # traced by this call: it recorded one decision per op
      program.traced.add(channel)
      got = [(d.op, d.channel, d.path) for d in list(comm.decisions)[-len(program.ops):]]
      want = [("all_reduce" if isinstance(op, AllReduce) else "dcp_a2a", channel,
               op.expected_path(comm.capacity_bytes)) for op in program.ops]
      assert got == want, f"torture seed={seed} {program} on {channel!r}: decisions {got}, expected {want}"
    if platform == "cpu":
      jax.block_until_ready(results)
    for op in program.ops:
      if op.expected_path(comm.capacity_bytes) == "b12x":
        b12x_calls[channel] += 1
    pending.append((run, program, channel, references, results))
    run += 1
    stats["runs"] += 1
    if len(pending) > in_flight:
      check_oldest()
    if log is not None and run % 100 == 0:
      log(f"torture: {run} runs, {stats['calls']} calls checked")
  while pending:
    check_oldest()
  for channel in channels:
    for d, start in zip(mesh.devices.flat, base[channel]):
      epoch = _epoch(comm, channel, d)
      assert epoch == start + b12x_calls[channel], \
          f"torture seed={seed}: {d} on {channel!r} at epoch {epoch}, expected {start} + {b12x_calls[channel]}"
  stats["ops"], stats["paths"] = dict(stats["ops"]), dict(stats["paths"])
  return stats
