"""Subprocess workers for tests that may hang or need their own XLA flags.

Run as ``python tests/workers.py MODE --platform cpu|gpu [--devices N]``;
prints one line ``RESULT <json>`` and exits 0 when its checks passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time


def _setup(platform: str, devices: int, xla_flags: str = "") -> None:
  flags = [xla_flags] if xla_flags else []
  if platform == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  inherited = [f for f in os.environ.get("XLA_FLAGS", "").split()  # the test process's device count is not ours
               if not f.startswith("--xla_force_host_platform_device_count")]
  os.environ["XLA_FLAGS"] = " ".join(flags + inherited).strip()


def timeout_mode(args) -> dict:
  """Rank 0 calls ``args.op`` (all_reduce with ``args.algorithm``, dcp_a2a
  or all_reduce_residual_rmsnorm), rank 1 never joins: the error must name
  the channel, rank, missing peer and epoch, within the timeout. Returns the
  messages, and for every call that returned an output (CUDA: the timed-out
  kernel's), whether rank 0's part of it is all NaN."""
  import jax
  import numpy as np
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  b12x_jax.set_communicator(b12x_jax.Communicator(timeout_s=args.timeout, lamport_bytes=args.lamport_bytes,
                                                  algorithm=args.algorithm))
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])

  if args.op == "all_reduce":
    def lonely(x):
      return b12x_jax.all_reduce(x, "x")
    x = np.ones((2 * 256,), np.float32)
  elif args.op == "residual_rmsnorm":
    def lonely(x):
      return b12x_jax.all_reduce_residual_rmsnorm(x, x, jax.numpy.ones(x.shape[-1:], x.dtype), "x")[0]
    x = np.ones((2 * 4, 512), np.float32)
  else:  # out [B, H, D] bfloat16 from the float input; each rank keeps H/2 heads, as the skipping branch does
    def lonely(x):
      out = b12x_jax.dcp_a2a(x.astype(jax.numpy.bfloat16), jax.numpy.zeros(x.shape[:2], np.float32), "x")
      return out.astype(x.dtype)
    x = np.ones((2 * 4, 8, 64), np.float32)

  def body(x):
    joined = jax.lax.axis_index("x") == 0
    skip = (lambda v: v[:, : v.shape[1] // 2]) if args.op == "dcp_a2a" else (lambda v: v)
    return jax.lax.cond(joined, lonely, skip, x)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("x")))
  start = time.monotonic()
  messages, nan_outputs = [], []
  with b12x_jax.channel("lonely"):
    for _ in range(2):  # the second call must fail fast: the channel is poisoned
      try:
        out = np.asarray(fn(x))
        nan_outputs.append(bool(np.isnan(out[: out.shape[0] // 2]).all()))
        b12x_jax.check_errors()
      except Exception as e:  # noqa: BLE001 - the test inspects the text
        messages.append(str(e))
  return {"messages": messages, "nan_outputs": nan_outputs, "seconds": time.monotonic() - start}


def graphs_mode(args) -> dict:
  """17 all-reduces in one executable, run `runs` times on fresh inputs:
  12 small ones (the Lamport path) and 5 just above the 1 MiB Lamport
  window (the barrier path), so both paths and both barrier slots alternate."""
  import jax
  import numpy as np
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  sys.path.insert(0, os.path.dirname(__file__))
  from helpers import assert_sum_matches

  n = 2
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  ops = 17

  def body(*xs):
    return tuple(b12x_jax.all_reduce(x, "x") for x in xs)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * ops, out_specs=(P("x"),) * ops))
  rng = np.random.default_rng(args.seed)
  sizes = [(1 << 18) + 256 * (i + 1) if i % 4 == 0 else 256 * (i + 1) for i in range(ops)]
  b12x_jax.set_communicator(b12x_jax.Communicator(poison_outputs=True))  # an element never written reads NaN
  with b12x_jax.channel("graphs"):
    for _ in range(args.runs):
      shards = [rng.standard_normal((n, s)).astype(np.float32) for s in sizes]
      outs = fn(*[jax.device_put(s.reshape(-1), jax.sharding.NamedSharding(mesh, P("x"))) for s in shards])
      for s, out in zip(shards, outs):
        assert_sum_matches(np.asarray(out).reshape(n, -1), s, "float32")
  b12x_jax.check_errors()
  epoch = b12x_jax.get_communicator().stats("graphs", jax.devices()[0])["epoch"]
  return {"epoch": epoch, "expected": ops * args.runs}


def dcp_mode(args) -> dict:
  """dcp_a2a merges interleaved with all-reduces on one channel, 12 calls in
  one executable (several grids: B of 1 to 64), run `runs` times on fresh
  inputs and checked against float64 attention over the whole KV."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  sys.path.insert(0, os.path.dirname(__file__))
  from helpers import assert_merge_matches, assert_sum_matches, attention_shards

  n, heads, dim = 2, 8, 128
  batches = [1, 8, 64, 3, 16, 2]
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  sharded = jax.sharding.NamedSharding(mesh, P("x"))

  def body(*args):
    results = []
    for out, lse, x in zip(args[0::3], args[1::3], args[2::3]):
      results.extend(b12x_jax.dcp_a2a(out, lse, "x", return_lse=True))
      results.append(b12x_jax.all_reduce(x, "x"))
    return tuple(results)

  specs = (P("x"),) * (3 * len(batches))
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs))
  rng = np.random.default_rng(args.seed)
  b12x_jax.set_communicator(b12x_jax.Communicator(poison_outputs=True))  # a row never written reads NaN, not 0
  with b12x_jax.channel("dcp"):
    for _ in range(args.runs):
      cases, inputs = [], []
      for b in batches:
        outs, lses, want, want_lse = attention_shards(rng, n, b, heads, dim, jnp.bfloat16, empty=((1, 0, 0),),
                                                      all_empty=((b - 1, heads - 1),))
        x = rng.standard_normal((n, 256 * b)).astype(np.float32)
        cases.append((outs, want, want_lse, x))
        inputs += [jax.device_put(a.reshape((-1,) + a.shape[2:]), sharded) for a in (outs, lses, x)]
      results = fn(*inputs)
      for (outs, want, want_lse, x), got, got_lse, y in zip(cases, results[0::3], results[1::3], results[2::3]):
        b = outs.shape[1]
        assert_merge_matches(np.asarray(got).reshape(n, b, heads // n, dim), np.asarray(got_lse).reshape(n, b, -1),
                             outs, want, want_lse, "bfloat16")
        assert_sum_matches(np.asarray(y).reshape(n, -1), x, "float32")
  b12x_jax.check_errors()
  paths = sorted({d.path for d in b12x_jax.get_communicator().decisions})
  epoch = b12x_jax.get_communicator().stats("dcp", jax.devices()[0])["epoch"]
  return {"epoch": epoch, "expected": 2 * len(batches) * args.runs, "paths": paths}


def torture_mode(args) -> dict:
  """tests/torture.py on the first ``devices`` devices with poison_outputs
  (an element no kernel wrote is NaN and fails its check): random programs
  on channels "target" and "draft" until ``calls`` collective calls were
  checked. Returns its counts."""
  import jax

  import b12x_jax
  sys.path.insert(0, os.path.dirname(__file__))
  from torture import run_torture

  b12x_jax.set_communicator(b12x_jax.Communicator(poison_outputs=True))
  mesh = jax.make_mesh((args.devices,), ("x",), devices=jax.devices()[:args.devices])
  result = run_torture(mesh, "x", seed=args.seed, calls=args.calls, programs=args.programs)
  b12x_jax.check_errors()
  return result


def _crossed(mesh, late: float):
  """Rank 0 runs a "target" then a "draft" all-reduce, rank 1 "draft" then
  "target": each waits for a call its peer queued behind the other one.
  Rank 1 reaches its first call ``late`` seconds after rank 0 (a host
  callback sleeps), so its timeout ends after rank 0's error was raised."""
  import jax
  from jax.sharding import PartitionSpec as P

  import b12x_jax

  def sleep_then(v):
    time.sleep(late)
    return v

  def in_order(first, second, delay):
    def run(x):
      if delay:
        x = jax.pure_callback(sleep_then, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
      a = b12x_jax.all_reduce(x, "x", channel=first)
      return a, b12x_jax.all_reduce(x + 0 * a, "x", channel=second)  # issued after the first
    return run

  def body(x):
    a, b = jax.lax.cond(jax.lax.axis_index("x") == 0, in_order("target", "draft", False),
                        in_order("draft", "target", late > 0), x)
    return a, b
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x")), check_vma=False))


def cross_mode(args) -> dict:
  """Collectives of two channels queued in opposite orders on the two ranks
  (what two threads dispatching target and draft may cause): the result
  must be the timeout error naming both channels, within one timeout (a
  rank whose peer gave up stops at once), never a number; after releasing
  the two channels they work again."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  sys.path.insert(0, os.path.dirname(__file__))
  from helpers import assert_sum_matches, random_shards

  comm = b12x_jax.Communicator(timeout_s=args.timeout, poison_outputs=True)
  b12x_jax.set_communicator(comm)
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  shards = random_shards(np.random.default_rng(args.seed), 2, 1024, np.float32)
  x = jax.device_put(shards.reshape(-1), NamedSharding(mesh, P("x")))
  crossed = _crossed(mesh, args.late)
  messages, finite = [], None
  start = time.monotonic()
  try:
    outs = [np.asarray(o) for o in crossed(x)]
    finite = bool(any(np.isfinite(o).any() for o in outs))
  except Exception as e:  # noqa: BLE001 - CPU raises from the call
    messages.append(str(e))
  try:
    b12x_jax.check_errors()
  except b12x_jax.CollectiveTimeoutError as e:
    messages.append(str(e))
  seconds = time.monotonic() - start
  for name in ("target", "draft"):
    comm.release(name)
  comm.prepare(mesh, "x", channels=["target", "draft"])
  reducer = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  for name in ("target", "draft"):
    with b12x_jax.channel(name):
      assert_sum_matches(np.asarray(reducer(x)).reshape(2, -1), shards, "float32")
  b12x_jax.check_errors()
  return {"messages": messages, "finite": finite, "seconds": seconds}


def mismatch_mode(args) -> dict:
  """helpers.mismatch_program on the first two devices: rank 0 at an
  all_reduce of 64 floats, rank 1 at one of 128 (with --op dcp_a2a: a merge
  of out [1, 32, 256] against [2, 16, 256], bfloat16: of one size, in one
  block of the host channel, told apart by their heads only). Each must
  stop with the error that names both calls, within the timeout, never
  return a number. Returns helpers.run_to_its_error's result."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  sys.path.insert(0, os.path.dirname(__file__))
  from helpers import mismatch_program, run_to_its_error
  b12x_jax.set_communicator(b12x_jax.Communicator(timeout_s=args.timeout, lamport_bytes=args.lamport_bytes,
                                                  algorithm=args.algorithm, poison_outputs=True))
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  rng = np.random.default_rng(args.seed)
  body, first = mismatch_program(args.op, 2, rng)
  ranks = [first, mismatch_program(args.op, 2, rng)[1]]  # each rank's inputs
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * len(first), out_specs=P("x"), check_vma=False))
  x = [jax.device_put(np.concatenate(parts), NamedSharding(mesh, P("x"))) for parts in zip(*ranks)]
  return run_to_its_error(lambda: fn(*x), "mismatch")


def protocols_mode(args) -> dict:
  """helpers.check_every_protocol for every algorithm on the first
  ``devices`` devices. Returns the calls checked."""
  import jax
  sys.path.insert(0, os.path.dirname(__file__))
  from helpers import check_every_protocol

  mesh = jax.make_mesh((args.devices,), ("x",), devices=jax.devices()[:args.devices])
  checked = sum(check_every_protocol(mesh, algorithm, args.seed) for algorithm in ("one_shot", "two_shot", "one_shot_pull"))
  return {"checked": checked}


def fused_mode(args) -> dict:
  """helpers.check_residual_rmsnorm_case on the first ``devices`` devices,
  for every dtype and a few shapes (one row, odd row counts, rows of 128 to
  4096 elements), with poisoned outputs. Returns the cases checked and the
  paths they took."""
  import jax
  import numpy as np
  sys.path.insert(0, os.path.dirname(__file__))
  from helpers import DTYPES, check_residual_rmsnorm_case, fresh_communicator

  import b12x_jax
  mesh = jax.make_mesh((args.devices,), ("x",), devices=jax.devices()[:args.devices])
  rng = np.random.default_rng(args.seed)
  checked = 0
  with fresh_communicator(poison_outputs=True) as comm, b12x_jax.channel("fused"):
    for dtype_name in DTYPES:
      for rows, hidden in ((1, 4096), (8, 1024), (5, 2048), (7, 128), (64, 256)):
        check_residual_rmsnorm_case(mesh, rng, rows, hidden, dtype_name)
        checked += 1
    paths = sorted({d.path for d in comm.decisions})
  return {"checked": checked, "paths": paths}


def race_mode(args) -> dict:
  """Two host threads dispatch the "target" and the "draft" executables
  ``runs`` times each, so the devices may queue them in different orders.
  Every output is classified: right, NaN (a call that could not finish: its
  finite elements, if any, right), or wrong (an element finite and not the
  sum: must never happen). The inputs cycle through more cases than can be
  in flight, so an output left from an earlier call is never taken for right. Errors raised in the
  threads and by check_errors() are returned for the test to read."""
  import threading

  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  sys.path.insert(0, os.path.dirname(__file__))
  from helpers import random_shards

  b12x_jax.set_communicator(b12x_jax.Communicator(timeout_s=args.timeout, poison_outputs=True))
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  rng = np.random.default_rng(args.seed)
  sizes = [64, 4096, 1 << 18]  # Lamport path, and the barrier path above 1 MiB of float32

  def body(*xs):
    return tuple(b12x_jax.all_reduce(v, "x") for v in xs)

  specs = (P("x"),) * len(sizes)
  in_flight = 32  # executions a thread keeps queued on a GPU before it reads the oldest
  cases = in_flight + 8
  programs = {}
  for name in ("target", "draft"):
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs))
    inputs = [[random_shards(rng, 2, s, np.float32) for s in sizes] for _ in range(cases)]
    placed = [[jax.device_put(a.reshape(-1), NamedSharding(mesh, P("x"))) for a in case] for case in inputs]
    wants = [[a.astype(np.float64).sum(axis=0) for a in case] for case in inputs]
    with b12x_jax.channel(name):
      jax.block_until_ready(fn(*placed[0]))  # compiled here, on its channel
    programs[name] = (fn, placed, wants)

  outcomes = {"right": 0, "nan": 0, "wrong": 0}
  errors: list[str] = []
  lock = threading.Lock()

  def classify(outs, want_case) -> None:
    for out, want in zip(outs, want_case):
      got = np.asarray(out).reshape(2, -1).astype(np.float64)
      finite = np.isfinite(got)
      if not all(np.allclose(g[f], want[f], rtol=1e-5, atol=1e-5) for g, f in zip(got, finite)):
        kind = "wrong"
      else:
        kind = "right" if finite.all() else "nan"
      with lock:
        outcomes[kind] += 1

  def dispatch(name: str) -> None:
    fn, placed, wants = programs[name]
    pending = []
    try:
      for i in range(args.runs):
        pending.append((fn(*placed[i % cases]), wants[i % cases]))
        if args.platform == "cpu" or len(pending) > in_flight:  # XLA:CPU: block between executions (README)
          classify(*pending.pop(0))
      for outs, want_case in pending:
        classify(outs, want_case)
    except Exception as e:  # noqa: BLE001 - the test reads the text
      with lock:
        errors.append(f"{name}: {e}")

  threads = [threading.Thread(target=dispatch, args=(name,)) for name in programs]
  start = time.monotonic()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  try:
    b12x_jax.check_errors()
  except b12x_jax.CollectiveTimeoutError as e:
    errors.append(f"check_errors: {e}")
  return {**outcomes, "errors": errors, "seconds": time.monotonic() - start, "calls": 2 * args.runs * len(sizes)}


def close_pending_mode(args) -> dict:
  """``runs`` calls dispatched without waiting, then close() at once. close
  waits for every dispatched execution (communicator.settle), so every
  result is right; a second close() is
  harmless. Any failure is reported, never a wrong number or a crash."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  sys.path.insert(0, os.path.dirname(__file__))
  from helpers import assert_sum_matches, random_shards

  comm = b12x_jax.Communicator(poison_outputs=True, timeout_s=args.timeout)
  b12x_jax.set_communicator(comm)
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  rng = np.random.default_rng(args.seed)
  cases = [random_shards(rng, 2, 4096, np.float32) for _ in range(args.runs)]
  with b12x_jax.channel("closing"):
    outs = [fn(jax.device_put(c.reshape(-1), NamedSharding(mesh, P("x")))) for c in cases]  # not waited for
  comm.close()
  comm.close()
  right, failed = 0, 0
  for c, out in zip(cases, outs):
    try:
      got = np.asarray(out).reshape(2, -1)
    except Exception as e:  # noqa: BLE001 - only the two clear errors are allowed
      assert re.search(r"channel 'closing' (is not prepared on device|rank \d timed out)", str(e)), e
      failed += 1
      continue
    assert_sum_matches(got, c, "float32")
    right += 1
  return {"right": right, "failed": failed, "prepared": sorted(comm.prepared_channels())}


def order_mode(args) -> dict:
  """``calls`` calls of ``op`` on one channel whose inputs do not depend on
  each other (helpers.independent_calls), in one jitted shard_map over
  ``devices`` ranks (on the protocol of ``lamport_bytes`` and ``algorithm``,
  outputs poisoned), run ``runs`` times on fresh integer inputs: a call
  paired with another call's data (DESIGN C15) shows up as a wrong value.
  Returns how many results were wrong, and the calls taken
  (helpers.calls_taken)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  sys.path.insert(0, os.path.dirname(__file__))
  from helpers import calls_taken, independent_calls, independent_wrong, integer_shards
  n = args.devices
  b12x_jax.set_communicator(b12x_jax.Communicator(lamport_bytes=args.lamport_bytes, algorithm=args.algorithm,
                                                  poison_outputs=True))
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  fn = jax.jit(jax.shard_map(independent_calls(args.calls, args.op), mesh=mesh, in_specs=P(None, "x"),
                             out_specs=P(None, "x"), check_vma=False))
  rng = np.random.default_rng(args.seed)
  wrong = 0
  with b12x_jax.channel("ordered"):
    for _ in range(args.runs):
      shards = integer_shards(rng, args.calls, n, args.elems)
      x = jax.device_put(shards.reshape(args.calls, -1), NamedSharding(mesh, P(None, "x")))
      wrong += independent_wrong(args.op, np.asarray(fn(x)).reshape(args.calls, n, args.elems), shards)
  b12x_jax.check_errors()
  return {"wrong": wrong, "results": args.runs * args.calls * n,
          "taken": calls_taken(b12x_jax.get_communicator().decisions)}


def exit_busy_mode(args) -> dict:
  """``runs`` all_reduces dispatched and never waited for, then the process
  exits: the exit hook waits for them, closes the channel and joins the host
  backend's progress thread, so the process ends cleanly (exit code 0, no
  "terminate called" from a thread still inside XLA)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  mesh = jax.make_mesh((args.devices,), ("x",), devices=jax.devices()[:args.devices])
  fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  x = jax.device_put(np.ones(args.devices * 4096, np.float32), NamedSharding(mesh, P("x")))
  with b12x_jax.channel("busy"):
    for _ in range(args.runs):
      x = fn(x) / args.devices  # chained, not waited for
  return {"dispatched": args.runs}


def wide_mode(args) -> dict:
  """An axis of ``devices`` (more than a channel's 8 ranks): prepare's
  error; all_reduce and the fused op over it (psum, unfused), their
  results and decisions; and the native layer's own refusal of such a
  group and of a capacity above its limit, asked directly."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  from b12x_jax import _native
  n = args.devices
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  comm = b12x_jax.get_communicator()
  errors = {}
  try:
    comm.prepare(mesh, "x", channels=["wide"])
  except Exception as e:  # noqa: BLE001 - the test reads the type and message
    errors["prepare"] = f"{type(e).__name__}: {e}"
  options = comm.native_options()
  try:
    _native.prepare("cpu", "wide-native", "p", list(range(n)), options)
  except Exception as e:  # noqa: BLE001
    errors["native_ranks"] = f"{type(e).__name__}: {e}"
  try:
    big = _native.channel_options(capacity_bytes=2 * _native.MAX_CAPACITY_BYTES, lamport_bytes=0, timeout_s=1.0,
                                  setup_timeout_s=1.0, max_blocks=None, poison_outputs=False)
    _native.prepare("cpu", "wide-native", "p", [0, 1], big)
  except Exception as e:  # noqa: BLE001
    errors["native_capacity"] = f"{type(e).__name__}: {e}"
  # 8 ranks of 1 GiB: 16 GiB of staging each. Tried only where that is beyond the machine's memory
  # (the memset of a group that fits would take it all).
  host_memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  if host_memory < 8 * 16 * 2**30:
    try:
      huge = _native.channel_options(capacity_bytes=_native.MAX_CAPACITY_BYTES, lamport_bytes=0, timeout_s=1.0,
                                     setup_timeout_s=1.0, max_blocks=None, poison_outputs=False)
      _native.prepare("cpu", "huge-native", "p", list(range(8)), huge)
    except Exception as e:  # noqa: BLE001
      errors["native_memory"] = f"{type(e).__name__}: {e}"
  rng = np.random.default_rng(args.seed)
  x = rng.standard_normal((n, 8, 64)).astype(np.float32)
  residual = rng.standard_normal((8, 64)).astype(np.float32)
  weight = rng.standard_normal(64).astype(np.float32)
  body = lambda v, r, w: (b12x_jax.all_reduce(v[0], "x"),  # noqa: E731
                          *b12x_jax.all_reduce_residual_rmsnorm(v[0], r, w, "x", eps=1e-6))
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=(P(), P(), P()),
                             check_vma=False))
  with b12x_jax.channel("wide"):
    total, normed, new_residual = (np.asarray(a, np.float64) for a in fn(
        jax.device_put(x, NamedSharding(mesh, P("x"))), residual, weight))
  want = x.astype(np.float64).sum(axis=0)
  want_residual = want + residual
  want_normed = want_residual / np.sqrt((want_residual ** 2).mean(-1, keepdims=True) + 1e-6) * weight
  return {"errors": errors, "host_memory": host_memory,
          "decisions": [(d.op, d.path, d.reason) for d in comm.decisions],
          "error": max(float(np.abs(total - want).max()), float(np.abs(new_residual - want_residual).max()),
                       float(np.abs(normed - want_normed).max()))}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("mode", choices=["timeout", "graphs", "dcp", "torture", "cross", "race", "close_pending",
                                      "mismatch", "protocols", "fused", "order", "exit_busy", "wide"])
  parser.add_argument("--platform", default="cpu")
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--timeout", type=float, default=1.0)
  parser.add_argument("--runs", type=int, default=200)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--calls", type=int, default=1000)
  parser.add_argument("--programs", type=int, default=12)
  parser.add_argument("--elems", type=int, default=1024)
  parser.add_argument("--lamport-bytes", type=int, default=1 << 20)
  parser.add_argument("--op", choices=["all_reduce", "dcp_a2a", "residual_rmsnorm"], default="all_reduce")
  parser.add_argument("--algorithm", choices=["auto", "one_shot", "two_shot", "one_shot_pull"], default="auto")
  parser.add_argument("--xla-flags", default="")
  parser.add_argument("--late", type=float, default=0.0)
  args = parser.parse_args()
  _setup(args.platform, args.devices, args.xla_flags)
  result = {"timeout": timeout_mode, "graphs": graphs_mode, "dcp": dcp_mode,
            "torture": torture_mode, "cross": cross_mode, "race": race_mode,
            "close_pending": close_pending_mode, "mismatch": mismatch_mode, "protocols": protocols_mode,
            "fused": fused_mode, "order": order_mode, "exit_busy": exit_busy_mode, "wide": wide_mode}[args.mode](args)
  print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
