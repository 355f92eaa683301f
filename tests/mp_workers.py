"""Worker processes of the multi-process tests: one device per process,
``jax.distributed`` on 127.0.0.1 (docs/DESIGN.md, "Transports"; C4, C11).

Run as ``python tests/mp_workers.py MODE --process-id I --num-processes N
--port P [--platform cpu|gpu|gpu_rig] [--communicator JSON]``; every
process prints one line ``RESULT <json>`` and exits 0 when its own checks
passed. The test (tests/test_multiprocess.py, through conftest's
``multiprocess`` fixture) compares the results across processes. On
``gpu`` process i takes GPU i; on ``gpu_rig`` every process takes GPU 0
(the one-GPU rig, conftest's ``gpu_rig``). ``--communicator`` holds the
Communicator keyword arguments of the modes that make their own
(all_reduce, dcp, residual_rmsnorm, never_calls).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import time


def _setup(args) -> None:
  if args.platform == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
    devices = os.environ.get("B12X_TEST_LOCAL_DEVICES", "1")  # uneven mode gives one process more
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  else:  # a test process that keeps off the GPU (JAX_PLATFORMS=cpu) still launches GPU workers
    os.environ.pop("JAX_PLATFORMS", None)
  import jax
  if args.platform == "cpu":
    # psum across CPU processes (the comparison and the fallback path) needs
    # a cross-process collectives backend on jax 0.11.2.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  gpu = {"gpu": [args.process_id], "gpu_rig": [0]}  # the rig: every process on the GPU it sees, GPU 0
  jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.num_processes, process_id=args.process_id,
                             local_device_ids=gpu.get(args.platform), initialization_timeout=60)


def _communicator(args, **options):
  """A Communicator with ``--communicator``'s arguments, then ``options``."""
  import b12x_jax
  return b12x_jax.Communicator(**{**json.loads(args.communicator), **options})


def _mesh():
  import jax
  return jax.make_mesh((jax.device_count(),), ("x",))


def _reducer(mesh, op):
  import jax
  from jax.sharding import PartitionSpec as P
  return jax.jit(jax.shard_map(lambda x: op(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def _run(fn, mesh, shards):
  """Runs ``fn`` on the global [n, elems] ``shards`` (every process holds all
  of them, from one seed) and returns this process's output row."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  me = jax.process_index()
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), shards[me])
  return np.asarray(fn(x).addressable_shards[0].data)


def _check(fn, mesh, rng, elems, dtype_name, roundings=1) -> str:
  """One call on fresh shards, checked against float64 here; returns the
  hash of this process's output bits, for the test to compare."""
  from helpers import DTYPES, assert_sum_matches, random_shards
  from b12x_jax import _native
  shards = random_shards(rng, mesh.size, elems, DTYPES[dtype_name])
  got = _run(fn, mesh, shards)
  try:
    assert_sum_matches(got[None], shards, dtype_name, roundings)
  except AssertionError as e:  # say which call, and what the channel recorded (CUDA: a failed kernel leaves NaN)
    raise AssertionError(f"{elems} x {dtype_name}: {e}; recorded: {_native.pending_errors()}") from None
  return hashlib.sha256(got.tobytes()).hexdigest()


def _mapped_shm() -> list[str]:
  """Shared-memory segments of b12x_jax this process maps or has left in /dev/shm."""
  with open("/proc/self/maps") as f:
    mapped = [line.split()[-1] for line in f if "/b12x." in line]
  left = [n for n in os.listdir("/dev/shm") if n.startswith(f"b12x.{os.getpid()}.")]
  return mapped + left


def _mapped_bytes() -> int:
  """Bytes of b12x_jax shared memory this process maps (named or not)."""
  total = 0
  with open("/proc/self/maps") as f:
    for line in f:
      if "/b12x." in line:
        start, end = (int(a, 16) for a in line.split()[0].split("-"))
        total += end - start
  return total


def _shm_names() -> set[str]:
  """Every b12x_jax name in /dev/shm, of any process."""
  return {n for n in os.listdir("/dev/shm") if n.startswith("b12x.")}


def _assert_head_shard(got, got_lse, outs, want, want_lse, mine: slice, dtype: str = "bfloat16") -> None:
  """This rank's head shard of a DCP merge ([B, H/n, D], and [B, H/n] or
  None) against the full attention ``want`` [B, H, D]
  (helpers.assert_merge_matches on the heads ``mine``)."""
  from helpers import assert_merge_matches
  assert_merge_matches(got[None], None if got_lse is None else got_lse[None], outs[:, :, mine], want[:, mine],
                       want_lse[:, mine], dtype)


def _merge_here(fn, mesh, rng, batch: int, per_rank: int, dim: int, dtype: str = "bfloat16", **shards):
  """One call of ``fn`` (jitted dcp_a2a over "x" on ``mesh``, with or
  without the merged lse) on fresh partials (helpers.attention_shards with
  ``shards``), this process's device fed the partials of its position in
  ``mesh``. Returns the merged out and lse (None without it) and a check of
  them against full attention on that position's head shard
  (_assert_head_shard)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from helpers import attention_shards
  n = mesh.devices.size
  position = list(mesh.devices.flat).index(jax.local_devices()[0])
  outs, lses, want, want_lse = attention_shards(rng, n, batch, per_rank * n, dim, jnp.dtype(dtype), **shards)
  o, l = (jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), a[position]) for a in (outs, lses))
  results = fn(o, l)
  got, got_lse = (np.asarray(r.addressable_shards[0].data) for r in results) if isinstance(results, tuple) else (
      np.asarray(results.addressable_shards[0].data), None)
  mine = slice(position * per_rank, (position + 1) * per_rank)
  return got, got_lse, lambda: _assert_head_shard(got, got_lse, outs, want, want_lse, mine, dtype)


# -- modes -----------------------------------------------------------------------


def all_reduce_mode(args) -> dict:
  """all_reduce across processes, several sizes and dtypes, both slots,
  under each Communicator of ``--configs`` in turn (a JSON list of keyword
  arguments over ``--communicator``'s: the Lamport window, the algorithm);
  psum on the same inputs for comparison (not on the rig). Returns the hashes of the
  outputs and each configuration's epoch."""
  import jax
  import numpy as np

  import b12x_jax
  from helpers import DTYPES
  mesh = _mesh()
  rng = np.random.default_rng(0)  # the same shards in every process
  hashes, epochs = {}, []
  for i, config in enumerate(json.loads(args.configs)):
    comm = _communicator(args, **config)
    b12x_jax.set_communicator(comm)  # traced again: the communicator is part of jit's cache key
    ours = _reducer(mesh, b12x_jax.all_reduce)
    with b12x_jax.channel("mp"):
      for dtype_name, nbytes in [("float32", 16), ("bfloat16", 4096), ("float16", 65536), ("float32", 1 << 20)]:
        elems = nbytes // np.dtype(DTYPES[dtype_name]).itemsize
        hashes[f"{i}/{dtype_name}/{nbytes}"] = [_check(ours, mesh, rng, elems, dtype_name) for _ in range(2)]
        assert comm.decisions[-1].path == "b12x", comm.decisions[-1]
    stats = comm.stats("mp", jax.local_devices()[0])
    epochs.append(stats["epoch"])
    b12x_jax.check_errors()
    comm.close()  # collective: every process runs the same configurations
  if args.platform != "gpu_rig":  # NCCL refuses two ranks on one GPU
    _check(_reducer(mesh, jax.lax.psum), mesh, rng, 256, "float32", roundings=jax.device_count())
  return {"hashes": hashes, "rank": stats["rank"], "world": stats["world"], "epochs": epochs}


# Limits that 3 blocks do not divide into 16-byte cells (4112 = 3 * 1360 + 32): a payload of the
# limit itself is taken at trace time and must run (ffi/channel.h, the one capacity rule).
EDGE_CONFIGS = [{"max_blocks": 3, "capacity_bytes": 4112, "lamport_bytes": 0},
                {"max_blocks": 3, "lamport_bytes": 4112}]


def capacity_edge_mode(args) -> dict:
  """all_reduce of payloads at the edge of the capacity and of the Lamport
  window under EDGE_CONFIGS, checked against float64 on every process.
  Returns the protocol each config's payload took."""
  import numpy as np

  import b12x_jax
  mesh = _mesh()
  rng = np.random.default_rng(0)
  paths = []
  for config in EDGE_CONFIGS:
    comm = _communicator(args, poison_outputs=True, **config)
    b12x_jax.set_communicator(comm)
    with b12x_jax.channel("edge"):
      for _ in range(2):
        _check(_reducer(mesh, b12x_jax.all_reduce), mesh, rng, 4112 // 4, "float32")
    paths.append("; ".join(d.reason for d in comm.decisions))  # a Triton kernel that cannot take it adds its own
    b12x_jax.check_errors()
    comm.close()
  return {"paths": paths}


def after_failure_mode(args) -> dict:
  """helpers.check_a_failed_call_leaves_later_calls_right across processes."""
  from helpers import check_a_failed_call_leaves_later_calls_right
  check_a_failed_call_leaves_later_calls_right(_mesh(), 1024)
  return {"checked": True}


def stale_replay_mode(args) -> dict:
  """A compiled executable that ran (on CUDA: its calls captured in a CUDA
  graph with the channel's view of that preparation), then its channel
  released and prepared again, which reuses the memory under a new
  generation (docs/DESIGN.md, "Lifetime"), then the executable again, inside
  and above the Lamport window. Returns, per size, whether the second run
  was right or left NaN, and the messages of check_errors: a replay of the
  graph must stop with the stale error, never run on the new preparation's
  memory with the old one's view; where the handler runs again (graphs off,
  the host) it takes the new view and is right."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  from helpers import assert_sum_matches, random_shards
  comm = _communicator(args, poison_outputs=True)
  b12x_jax.set_communicator(comm)
  mesh, me = _mesh(), jax.process_index()
  fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  rng = np.random.default_rng(17)
  results = {}
  for elems in (1024, 1 << 19):
    channel = f"stale-{elems}"
    put = lambda shards: jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), shards[me])  # noqa: E731
    with b12x_jax.channel(channel):
      shards = random_shards(rng, jax.device_count(), elems, np.float32)
      compiled = fn.lower(put(shards)).compile()
      for _ in range(2):
        shards = random_shards(rng, jax.device_count(), elems, np.float32)
        assert_sum_matches(np.asarray(compiled(put(shards)).addressable_shards[0].data)[None], shards, "float32")
      comm.release(channel)
      comm.prepare(mesh, "x", channels=[channel])
      shards = random_shards(rng, jax.device_count(), elems, np.float32)
      messages, got = [], None
      try:
        got = np.asarray(compiled(put(shards)).addressable_shards[0].data)
      except Exception as e:  # noqa: BLE001 - the error of a handler that found the stale record
        messages = [str(e)]
      # Right, or no finite element at all: a wrong number fails here, whatever the messages say.
      right = got is not None and bool(np.isfinite(got).all())
      if right:
        assert_sum_matches(got[None], shards, "float32")
      else:
        assert got is None or not np.isfinite(got).any(), (elems, "finite elements in a failed call's output")
      try:
        b12x_jax.check_errors()
      except b12x_jax.B12xError as e:
        messages += str(e).splitlines()
      results[str(elems)] = {"right": right, "messages": messages}
  return results


def wrap_mode(args) -> dict:
  """all_reduce inside and above the Lamport window across the uint32 wrap
  of the counters (docs/DESIGN.md, "Wrap"), between processes: the hook on
  every process, a barrier (peers write into the Signal the hook writes),
  then 12 calls of each on fresh inputs, checked against float64."""
  import jax
  import numpy as np

  import b12x_jax
  from b12x_jax import _compat
  comm = _communicator(args, poison_outputs=True, lamport_bytes=4096)
  b12x_jax.set_communicator(comm)
  mesh = _mesh()
  comm.prepare(mesh, "x", channels=["wrap"])
  comm._start_counters("wrap", 2**32 - 5)
  # The KV store's barrier, not an XLA collective (NCCL takes no two ranks on one GPU: the rig).
  _compat.distributed_client().wait_at_barrier("b12x_jax_wrap_counters", 60_000)
  ours = _reducer(mesh, b12x_jax.all_reduce)
  rng = np.random.default_rng(1)  # the same shards in every process
  with b12x_jax.channel("wrap"):
    hashes = [_check(ours, mesh, rng, elems, "float32") for _ in range(12) for elems in (256, 1024 + 4)]
  b12x_jax.check_errors()
  return {"hashes": hashes, "epoch": comm.stats("wrap", jax.local_devices()[0])["epoch"]}


# dcp_mode's calls: (dtype, B, heads per rank, D). Decode sizes in the
# Lamport window: a batch row's heads in one block or split (B = 1), odd B,
# one head per rank (a cell's lse padded to a pack), float16 (no Triton
# kernel); and B = 67, more batch rows than the rig's blocks (whole rows per
# block: no Triton kernel), whose last block is shorter (on the barrier
# protocol too).
DCP_CASES = (("bfloat16", 1, 8, 128), ("bfloat16", 8, 4, 128), ("bfloat16", 3, 4, 16), ("bfloat16", 2, 1, 64),
             ("float16", 2, 4, 64), ("bfloat16", 67, 4, 64))
# dcp_mode's rounds, (return_lse, lse_base): every kernel variant (the
# Triton kernel is specialised on both).
DCP_VARIANTS = ((True, "e"), (False, "2"), (True, "2"), (False, "e"))


def dcp_mode(args) -> dict:
  """dcp_a2a across processes, each process feeding its own KV shard's
  partial attention: every DCP_CASES shape in each DCP_VARIANTS (with
  and without the merged lse, from lse in base e and base 2), interleaved on one
  channel (with lamport_bytes=0 in --communicator, on the barrier
  protocol; with kernels="triton", bfloat16 on the Triton kernel on CUDA),
  from 5 calls below the counters' wrap with --wrap; this process's head
  shard against full attention in float64 (an empty shard with NaN payload
  included). Returns each case's kernels and protocols and the channel's
  epoch."""
  import jax
  import numpy as np
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  from b12x_jax import _compat
  comm = _communicator(args)
  b12x_jax.set_communicator(comm)
  mesh = _mesh()
  n, me = jax.device_count(), jax.process_index()
  fns = {(return_lse, base): jax.jit(jax.shard_map(
      lambda o, l, return_lse=return_lse, base=base: b12x_jax.dcp_a2a(o, l, "x", return_lse=return_lse, lse_base=base),
      mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x")) if return_lse else P("x")))
         for return_lse, base in DCP_VARIANTS}
  if args.wrap:
    comm.prepare(mesh, "x", channels=["mp_dcp"])
    comm._start_counters("mp_dcp", 2**32 - 5)
    _compat.distributed_client().wait_at_barrier("b12x_jax_dcp_wrap_counters", 60_000)
  rng = np.random.default_rng(0)  # the same shards in every process
  kernels: dict[str, list[str]] = {}
  protocols: dict[str, list[str]] = {}
  with b12x_jax.channel("mp_dcp"):
    for return_lse, base in DCP_VARIANTS:
      for dtype, batch, per_rank, dim in DCP_CASES:
        heads = per_rank * n
        decided = len(comm.decisions)
        *_, check = _merge_here(fns[return_lse, base], mesh, rng, batch, per_rank, dim, dtype,
                                base2=base == "2", empty=((0, 0, 0),))
        check()
        # Each variant traced once per shape: its decisions.
        for decision in comm.decisions[decided:]:
          assert decision.path == "b12x", decision
          kernels.setdefault(f"{dtype}/{batch}x{heads}x{dim}", []).append(decision.kernel)
          protocols.setdefault(f"{dtype}/{batch}x{heads}x{dim}", []).append(
              "lamport" if "; lamport (" in decision.reason else "barrier")
  b12x_jax.check_errors()
  return {"rank": me, "kernels": kernels, "protocols": protocols,
          "epoch": comm.stats("mp_dcp", jax.local_devices()[0])["epoch"]}


FUSED_CASES = ((1, 4096), (8, 4096), (8, 1024), (5, 2048), (7, 128), (3, 16), (2, 8192))


def residual_rmsnorm_mode(args) -> dict:
  """all_reduce_residual_rmsnorm across processes: each process feeds its
  own shard of x (residual and weight are the same everywhere) and checks
  its results against float64, for each dtype and a few shapes, on fresh
  inputs. Returns the hashes of the results, for the test to compare, and
  the kernel kinds each call's decisions name (at trace time, and a
  lowering's fallback). With ``--wrap`` the calls cross the uint32 wrap of
  the counters (the hook, a barrier, then the calls), twice over the shapes:
  the Triton kernel's split rows (float32 1 x 4096 and 2 x 8192, bfloat16
  2 x 8192, over 4 programs; float32 8 x 4096 over 4, 2 or 1 with the rig's
  64 / n blocks at n = 2, 4, 8) meet 6 to 8 times on block 0, whose meeting
  word starts 5 before its wrap: rows of 4 programs, then 2 or 1, then 4
  again."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  from b12x_jax import _compat
  from helpers import DTYPES, assert_residual_rmsnorm_matches, residual_rmsnorm_fn, residual_rmsnorm_inputs
  comm = _communicator(args)
  b12x_jax.set_communicator(comm)
  mesh = _mesh()
  if args.wrap:
    comm.prepare(mesh, "x", channels=["mp_fused"])
    comm._start_counters("mp_fused", 2**32 - 5)
    _compat.distributed_client().wait_at_barrier("b12x_jax_fused_wrap_counters", 60_000)
  fn, me, eps = residual_rmsnorm_fn(mesh), jax.process_index(), 1e-6
  rng = np.random.default_rng(6)  # the same inputs in every process
  hashes, kernels = {}, {}
  with b12x_jax.channel("mp_fused"):
    for _, dtype_name in itertools.product(range(2 if args.wrap else 1), DTYPES):
      # Inside the Lamport cells of 64 blocks. 3 rows of 16: rows narrower than a warp (the Triton
      # kernel reads them again after its polls); 4096 words or more: a row over several programs (fewer
      # where 4 a row would take more than the channel's blocks).
      for rows, hidden in FUSED_CASES:
        decided = len(comm.decisions)
        shards, residual, weight = residual_rmsnorm_inputs(rng, jax.device_count(), rows, hidden, dtype_name)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), shards[me:me + 1])
        r, w = (jax.make_array_from_process_local_data(NamedSharding(mesh, P()), a) for a in (residual, weight))
        normed, new_residual = (np.asarray(o.addressable_shards[0].data) for o in fn(x, r, w))
        assert_residual_rmsnorm_matches(normed, new_residual, shards, residual, weight, eps, dtype_name)
        fused = [d for d in comm.decisions if d.op == "all_reduce_residual_rmsnorm"][-1]
        assert fused.path == "b12x", fused
        hashes[f"{dtype_name}/{rows}x{hidden}"] = hashlib.sha256(normed.tobytes() + new_residual.tobytes()).hexdigest()
        kernels.setdefault(f"{dtype_name}/{rows}x{hidden}", [d.kernel for d in comm.decisions[decided:]])
  b12x_jax.check_errors()
  return {"hashes": hashes, "kernels": kernels, "epoch": comm.stats("mp_fused", jax.local_devices()[0])["epoch"]}


def never_calls_mode(args) -> dict:
  """Every process prepares channel "lonely" (by lowering the same
  all-reduce, with --op dcp_a2a the same DCP merge of a decode-sized call,
  with --op residual_rmsnorm the fused op on a row of 4096 float32 words,
  which the Triton kernel spreads over 4 programs), then the last process
  never calls it: each other one must
  get the timeout error naming the channel, its rank, the peer and the
  epoch, within a bounded time, twice (the second call fails fast on the
  poisoned channel), and on CUDA NaN outputs, never a number. The last
  process leaves at once; its collective release at exit waits for the
  others."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  # Its first call waits up to setup_timeout_s (start-up skew): the same bound here.
  b12x_jax.set_communicator(_communicator(args, timeout_s=args.timeout, setup_timeout_s=args.timeout,
                                          poison_outputs=True))
  mesh = _mesh()
  me = jax.process_index()
  specs = (P("x"), P("x"))
  if args.op == "dcp_a2a":  # bfloat16 [2, 4 heads per rank, 64] in the Lamport window
    import jax.numpy as jnp
    inputs = (np.ones((2, 4 * jax.device_count(), 64), jnp.bfloat16), np.zeros((2, 4 * jax.device_count()), np.float32))
    fn = jax.jit(jax.shard_map(lambda o, l: b12x_jax.dcp_a2a(o, l, "x"), mesh=mesh, in_specs=specs,
                               out_specs=P("x")))
  elif args.op == "residual_rmsnorm":  # x [1 row per rank], residual and weight replicated
    inputs = (np.ones((1, 1, 4096), np.float32), np.ones((1, 4096), np.float32), np.ones(4096, np.float32))
    specs = (P("x"), P(), P())
    fn = jax.jit(jax.shard_map(lambda x, r, w: b12x_jax.all_reduce_residual_rmsnorm(x[0], r, w, "x")[0], mesh=mesh,
                               in_specs=specs, out_specs=P()))
  else:
    inputs, fn = (np.ones(4096, np.float32),), _reducer(mesh, b12x_jax.all_reduce)
  x = [jax.make_array_from_process_local_data(NamedSharding(mesh, spec), a) for a, spec in zip(inputs, specs)]
  with b12x_jax.channel("lonely"):
    call = fn.lower(*x).compile()  # prepares the channel, collectively
  kernels = sorted({d.kernel for d in b12x_jax.get_communicator().decisions if d.kernel})
  if me == jax.process_count() - 1:
    return {"called": False, "kernels": kernels}
  messages, nan_outputs = [], []
  start = time.monotonic()
  for _ in range(2):
    try:
      got = np.asarray(call(*x).addressable_shards[0].data, np.float32)
      nan_outputs.append(bool(np.isnan(got).all()))
      b12x_jax.check_errors()  # CUDA: the timed-out kernel leaves NaN and this record
    except Exception as e:  # noqa: BLE001 - CPU raises from the call (an XLA runtime error), CUDA from check_errors
      messages.append(str(e))
  return {"called": True, "messages": messages, "nan_outputs": nan_outputs, "seconds": time.monotonic() - start,
          "kernels": kernels}


def mismatch_mode(args) -> dict:
  """helpers.mismatch_program, a process per rank: the last process runs
  another call than the others on channel "mismatch". Every process must
  stop with an error, within a bounded time, never return a number (on
  CUDA: NaN outputs, then check_errors). Returns helpers.run_to_its_error's
  result and the kernels that ran."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  from helpers import mismatch_program, run_to_its_error
  b12x_jax.set_communicator(_communicator(args, timeout_s=args.timeout, setup_timeout_s=args.timeout,
                                          poison_outputs=True))
  mesh = _mesh()
  body, inputs = mismatch_program(args.op, jax.device_count(), np.random.default_rng(jax.process_index()))
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * len(inputs), out_specs=P("x"), check_vma=False))
  x = [jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), a) for a in inputs]
  result = run_to_its_error(lambda: fn(*x).addressable_shards[0].data, "mismatch")
  return {**result, "kernels": sorted({d.kernel for d in b12x_jax.get_communicator().decisions if d.kernel})}


def misplaced_export_mode(args) -> dict:
  """A jax.export of dcp_a2a on the mesh [d0, d1, ...] (one device per
  process) called on the mesh in reverse: every device runs at another mesh
  position than its module was lowered for, so the module's group names
  the peers of another position (docs/DESIGN.md, "Placement"). Called on
  its own mesh first, then reversed, then, after release and prepare, on
  its own mesh again. Returns whether the first and last runs matched full
  attention on this process's head shard, and run_to_its_error's result of
  the reversed run."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  from helpers import run_to_its_error
  comm = _communicator(args, timeout_s=args.timeout, setup_timeout_s=args.timeout, poison_outputs=True)
  b12x_jax.set_communicator(comm)
  n, me = jax.device_count(), jax.process_index()
  exported_on, called_on = Mesh(np.array(jax.devices()), ("x",)), Mesh(np.array(jax.devices()[::-1]), ("x",))
  batch, per_rank, dim = 2, 2, 64
  body = lambda o, l: b12x_jax.dcp_a2a(o, l, "x", return_lse=True)  # noqa: E731
  fn = jax.jit(jax.shard_map(body, mesh=exported_on, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
  specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(exported_on, P("x")))
           for shape, dtype in (((n * batch, per_rank * n, dim), jnp.bfloat16), ((n * batch, per_rank * n), jnp.float32))]
  with b12x_jax.channel("misplaced"):
    exported = jax.export.export(fn, disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("b12x_dcp_a2a")])(
        *specs)
  call = jax.jit(exported.call)
  rng = np.random.default_rng(0)  # the same shards in every process

  def run(mesh):
    """This process's results on fresh inputs, and their check: full
    attention on the head shard of this device's position in ``mesh``."""
    return _merge_here(call, mesh, rng, batch, per_rank, dim)

  *_, check = run(exported_on)
  check()
  result = run_to_its_error(lambda: run(called_on)[0], "misplaced")
  comm.release("misplaced")
  comm.prepare(exported_on, "x", channels=["misplaced"])
  *_, check = run(exported_on)
  check()
  b12x_jax.check_errors()
  return {**result, "rank": me}


def order_mode(args) -> dict:
  """Channels requested in a different order on each process still pair by name."""
  import jax
  import numpy as np

  import b12x_jax
  mesh = _mesh()
  names = ["beta", "alpha", "gamma"]
  order = names if jax.process_index() % 2 == 0 else names[::-1]
  comm = b12x_jax.get_communicator()
  comm.prepare(mesh, "x", channels=order)
  ours = _reducer(mesh, b12x_jax.all_reduce)
  rng = np.random.default_rng(1)
  hashes = {}
  for name in names:  # run in one order everywhere: a process dispatches its executables in order (C13)
    with b12x_jax.channel(name):
      hashes[name] = _check(ours, mesh, rng, 64 + len(name) * 16, "float32")
  return {"hashes": hashes, "prepared": sorted(comm.prepared_channels()),
          "epochs": {n: comm.stats(n, jax.local_devices()[0])["epoch"] for n in names}}


def failed_prepare_mode(args) -> dict:
  """A failure on one process, at allocation and then at opening, makes every
  process raise with nothing left mapped; then the channel prepares fine."""
  import jax
  import numpy as np

  import b12x_jax
  from b12x_jax import _native
  mesh = _mesh()
  comm = b12x_jax.get_communicator()
  me = jax.process_index()
  errors = {}
  for step, target, victim in [("allocated", "share", 0), ("opened", "open_peer", 1)]:
    original = getattr(_native, target)

    def injected(*a, _step=step, **k):
      raise b12x_jax.TransportError(f"injected failure at {_step}")

    if me == victim:
      setattr(_native, target, injected)
    try:
      comm.prepare(mesh, "x", channels=["doomed"])
    except b12x_jax.TransportError as e:
      errors[step] = str(e)
    finally:
      setattr(_native, target, original)
    assert "doomed" not in comm.prepared_channels()
    assert not _mapped_shm(), _mapped_shm()
  with b12x_jax.channel("doomed"):
    value = _check(_reducer(mesh, b12x_jax.all_reduce), mesh, np.random.default_rng(2), 64, "float32")
  return {"errors": errors, "hash": value}


def small_shm_mode(args) -> dict:
  """In a /dev/shm too small for the default channel's segments (the test
  mounts a small one for all processes): preparing it raises the
  TransportError that names the fix, with nothing left mapped or named;
  with capacity_bytes lowered as it says, a channel prepares and sums right."""
  import numpy as np

  import b12x_jax
  mesh = _mesh()
  error = None
  try:
    b12x_jax.get_communicator().prepare(mesh, "x", channels=["default-size"])
  except b12x_jax.TransportError as e:
    error = str(e)
  left = _mapped_shm()
  b12x_jax.set_communicator(b12x_jax.Communicator(capacity_bytes=1 << 20))
  with b12x_jax.channel("smaller"):
    value = _check(_reducer(mesh, b12x_jax.all_reduce), mesh, np.random.default_rng(4), 4096, "float32")
  return {"error": error, "left": left, "hash": value}


def reuse_cycles_mode(args) -> dict:
  """``--cycles`` throwaway channels across processes, every other one
  under a new name: each preparation reuses the memory the last release
  left (renamed where the name is new), so every cycle maps what the first
  did. Returns the bytes mapped after each cycle."""
  import numpy as np

  import b12x_jax
  mesh = _mesh()
  comm = b12x_jax.get_communicator()
  ours = _reducer(mesh, b12x_jax.all_reduce)
  rng = np.random.default_rng(5)
  mapped = []
  for cycle in range(args.cycles):
    with comm.throwaway("scratch" if cycle % 2 == 0 else f"scratch-{cycle}"):
      _check(ours, mesh, rng, 64, "float32")
    mapped.append(_mapped_bytes())
  return {"mapped": mapped}


def dies_preparing_mode(args) -> dict:
  """Process 1 dies (SIGKILL) while it opens its peers' memory, after both
  published their segments: process 0's preparation fails within the setup
  timeout, and no b12x_jax name of either process is left in /dev/shm.
  Returns process 0's error and the names left."""
  import signal

  import jax

  import b12x_jax
  from b12x_jax import _native
  before = _shm_names()
  if jax.process_index() == 1:
    _native.open_peer = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
  comm = b12x_jax.Communicator(setup_timeout_s=args.setup_timeout)
  b12x_jax.set_communicator(comm)
  try:
    comm.prepare(_mesh(), "x", channels=["mortal"])
    message = None
  except b12x_jax.B12xError as e:
    message = str(e)
  time.sleep(0.5)  # the peer's death is complete, its mappings gone
  # Printed here, then out: jax.distributed's shutdown would wait for the dead peer.
  print("RESULT " + json.dumps({"message": message, "left": sorted(_shm_names() - before)}), flush=True)
  os._exit(0)


def never_joins_mode(args) -> dict:
  """The last process never prepares; the others do, those from 1 on
  after 3/4 of the setup timeout: every one that prepares gets the timeout
  error within one bound of its own, not one per peer."""
  import jax

  import b12x_jax
  if jax.process_index() == jax.process_count() - 1:
    time.sleep(args.setup_timeout + 2)
    return {"joined": False}
  if jax.process_index() > 0:
    time.sleep(0.75 * args.setup_timeout)
  b12x_jax.set_communicator(b12x_jax.Communicator(setup_timeout_s=args.setup_timeout))
  start = time.monotonic()
  try:
    b12x_jax.get_communicator().prepare(_mesh(), "x", channels=["alone"])
    message = None
  except b12x_jax.CollectiveTimeoutError as e:
    message = str(e)
  return {"message": message, "seconds": time.monotonic() - start, "mapped": _mapped_shm()}


def close_after_peer_died_mode(args) -> dict:
  """Both processes prepare three channels; process 1 dies (SIGKILL), and
  process 0 closes: it must not wait the setup timeout once per channel.
  Returns how long close took and what it raised."""
  import signal

  import jax

  import b12x_jax
  comm = b12x_jax.Communicator(setup_timeout_s=args.setup_timeout)
  b12x_jax.set_communicator(comm)
  comm.prepare(_mesh(), "x", channels=["a", "b", "c"])
  if jax.process_index() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
  time.sleep(1)
  start = time.monotonic()
  try:
    comm.close()
    error = None
  except b12x_jax.B12xError as e:
    error = type(e).__name__
  print("RESULT " + json.dumps({"seconds": time.monotonic() - start, "error": error,
                                "prepared": sorted(comm.prepared_channels())}), flush=True)
  os._exit(0)  # jax.distributed's shutdown would wait for the dead peer


def elsewhere_mode(args) -> dict:
  """Process 0 prepares channel "target", process 1 "draft": each times
  out waiting for the other; returns the message."""
  import jax

  import b12x_jax
  b12x_jax.set_communicator(b12x_jax.Communicator(setup_timeout_s=args.setup_timeout))
  try:
    b12x_jax.get_communicator().prepare(_mesh(), "x", channels=[("target", "draft")[jax.process_index()]])
  except b12x_jax.CollectiveTimeoutError as e:
    return {"message": str(e)}
  return {"message": None}


def met_apart_mode(args) -> dict:
  """The processes first call channels "a" and "b" in opposite orders (a
  user error: the first of each waits for the other in vain), then both in
  the same order, twice. Returns each round's outcome of each channel: the
  hash of a right sum, or the error."""
  import jax
  import numpy as np

  import b12x_jax
  b12x_jax.set_communicator(b12x_jax.Communicator(setup_timeout_s=args.setup_timeout))
  mesh = _mesh()
  fn = _reducer(mesh, b12x_jax.all_reduce)
  rounds = []
  for i, order in enumerate((("a", "b") if jax.process_index() == 0 else ("b", "a"), ("a", "b"), ("a", "b"))):
    outcomes = {}
    for channel in order:
      rng = np.random.default_rng([i, ord(channel)])  # the same shards in every process, whatever ran before
      try:
        with b12x_jax.channel(channel):
          outcomes[channel] = _check(fn, mesh, rng, 64, "float32")
      except b12x_jax.B12xError as e:
        outcomes[channel] = f"{type(e).__name__}: {e}"
    rounds.append(outcomes)
  return {"rounds": rounds}


def threads_trace_mode(args) -> dict:
  """Two functions lowered and compiled in two threads (a warm-up in a
  thread pool), then run, the same order in every process. ``--op
  all_reduce``: both on one channel, at once in process 0, one after the
  other in process 1; ``--op all_reduce_site``: on channels "a" and "b",
  the second thread 0.3 s after the first, which takes "a" in process 0
  and "b" in process 1. Returns the errors."""
  import threading
  import time

  import jax
  import numpy as np

  import b12x_jax
  b12x_jax.set_communicator(b12x_jax.Communicator(setup_timeout_s=args.setup_timeout))
  mesh = _mesh()
  crossed = args.op == "all_reduce_site"
  scales = {"a": 1.0, "b": 2.0} if crossed else {"warm 1": 1.0, "warm 2": 2.0}
  fns = {name: _reducer(mesh, lambda v, a, scale=scale: b12x_jax.all_reduce(v * scale, a))
         for name, scale in scales.items()}
  shards = np.random.default_rng(13).standard_normal((mesh.size, 64)).astype(np.float32)
  x = jax.make_array_from_process_local_data(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")),
                                             shards[jax.process_index()])
  order = list(scales) if jax.process_index() == 0 or not crossed else list(reversed(scales))
  compiled, errors = {}, []

  def warm(i: int) -> None:
    name = order[i]
    try:
      time.sleep(0.3 * i if crossed else 0.0)
      with b12x_jax.channel(name if crossed else "warm"):
        compiled[name] = fns[name].lower(x).compile()
    except b12x_jax.B12xError as e:
      errors.append(f"{type(e).__name__}: {e}")

  if jax.process_index() == 0 or crossed:
    threads = [threading.Thread(target=warm, args=(i,)) for i in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  else:
    warm(0)
    warm(1)
  if errors:
    return {"errors": errors}
  want = shards.astype(np.float64).sum(axis=0)
  for name, scale in scales.items():
    got = np.asarray(compiled[name](x).addressable_shards[0].data)
    np.testing.assert_allclose(got, scale * want, rtol=1e-5, atol=1e-5)
  return {"errors": []}


def slow_reset_mode(args) -> dict:
  """Four rounds of one call on channel "a", released after the first: the
  second reuses the released memory, and the last process resets its part
  (_native.revive) later than the others wait for it. Returns each round's
  hash of a right sum, or its error."""
  import time

  import jax
  import numpy as np

  import b12x_jax
  from b12x_jax import _native, rendezvous
  comm = b12x_jax.Communicator(setup_timeout_s=args.setup_timeout)
  b12x_jax.set_communicator(comm)
  if jax.process_index() == jax.process_count() - 1:
    revive, revived = _native.revive, []

    def slow(*a, **k):
      revived.append(1)
      if len(revived) == 1:
        time.sleep(args.setup_timeout + 1)
      return revive(*a, **k)

    rendezvous._native.revive = slow
  mesh = _mesh()
  fn = _reducer(mesh, b12x_jax.all_reduce)
  rounds = []
  for i in range(4):
    try:
      with b12x_jax.channel("a"):
        rounds.append(_check(fn, mesh, np.random.default_rng([14, i]), 64, "float32"))
    except b12x_jax.B12xError as e:
      rounds.append(f"{type(e).__name__}: {e}")
    if i == 0:
      comm.release("a")
  return {"rounds": rounds}


def close_twice_mode(args) -> dict:
  import numpy as np

  import b12x_jax
  mesh = _mesh()
  comm = b12x_jax.get_communicator()
  with b12x_jax.channel("closing"):
    _check(_reducer(mesh, b12x_jax.all_reduce), mesh, np.random.default_rng(3), 64, "float32")
  comm.close()
  comm.close()
  left = [n for n in os.listdir("/dev/shm") if n.startswith(f"b12x.{os.getpid()}.")]
  return {"closed": comm.closed, "prepared": sorted(comm.prepared_channels()), "mapped": _mapped_shm(), "left": left}


def throwaway_mode(args) -> dict:
  """A throwaway channel is released after success and after failure, and
  prepared again later under the same name."""
  import jax
  import numpy as np

  import b12x_jax
  mesh = _mesh()
  comm = b12x_jax.get_communicator()
  ours = _reducer(mesh, b12x_jax.all_reduce)
  rng = np.random.default_rng(4)
  with comm.throwaway("profile"):
    _check(ours, mesh, rng, 64, "float32")
  after_success = sorted(comm.prepared_channels())
  failure = None
  try:
    with comm.throwaway("profile"):
      comm.prepare(mesh, "x", channels=["profile"])  # the cached executable lowers no more: prepare it
      _check(ours, mesh, rng, 64, "float32")
      raise RuntimeError("profiling failed")
  except RuntimeError as e:
    failure = str(e)
  after_failure = sorted(comm.prepared_channels())
  comm.prepare(mesh, "x", channels=["profile"])
  with b12x_jax.channel("profile"):
    value = _check(ours, mesh, rng, 64, "float32")
  epoch = comm.stats("profile", jax.local_devices()[0])["epoch"]
  return {"after_success": after_success, "failure": failure, "after_failure": after_failure, "hash": value,
          "epoch": epoch}


def exit_pending_mode(args) -> dict:
  """Dispatch work and exit without close(): the exit hook waits for it and
  releases collectively before jax.distributed shuts down."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  mesh = _mesh()
  ours = _reducer(mesh, b12x_jax.all_reduce)
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones(256, np.float32))
  with b12x_jax.channel("pending"):
    ours(x)  # not waited for
  return {"dispatched": True}


def killed_peer_mode(args) -> dict:
  """Process 1 runs a few calls and is killed (SIGKILL) mid-run; process 0
  keeps calling and must raise the timeout error within the timeout, and
  never return a wrong number. It then leaves through os._exit after
  printing its result: the collective close would wait setup_timeout_s for
  the dead peer, and jax.distributed's shutdown aborts the process then."""
  import signal

  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  from helpers import assert_sum_matches, random_shards
  b12x_jax.set_communicator(b12x_jax.Communicator(timeout_s=args.timeout))
  mesh = _mesh()
  ours = _reducer(mesh, b12x_jax.all_reduce)
  rng = np.random.default_rng(9)
  me, calls_before_kill = jax.process_index(), 3
  done, message, wrong, start = 0, None, 0, None
  with b12x_jax.channel("mortal"):
    for call in range(calls_before_kill + 5):
      shards = random_shards(rng, jax.device_count(), 4096, np.float32)
      if me == 1 and call == calls_before_kill:
        os.kill(os.getpid(), signal.SIGKILL)
      x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), shards[me])
      start = time.monotonic()
      try:
        got = np.asarray(ours(x).addressable_shards[0].data)
        b12x_jax.check_errors()  # on CUDA a timed-out kernel leaves NaN and this record
      except Exception as e:  # noqa: BLE001 - CPU raises from the call (an XLA runtime error), CUDA from check_errors
        message = str(e)
        break
      try:
        assert_sum_matches(got[None], shards, "float32")
        done += 1
      except AssertionError:  # NaN is the failed-call marker: any finite element must still be the sum
        finite = np.isfinite(got)
        want = shards.astype(np.float64).sum(axis=0)
        wrong += int(not np.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5))
  print("RESULT " + json.dumps({"done": done, "message": message, "wrong": wrong,
                                "seconds": time.monotonic() - start}), flush=True)
  os._exit(0)


def _reprepare_check(op: str, mesh, rng):
  """reprepare_mode's calls of ``op``, each checked against float64 here: a
  function that runs them on fresh inputs and returns the hashes of this
  process's outputs. all_reduce: 4096 and 2**19 float32 (within the Lamport
  window and above it, on the Communicator's algorithm); dcp_a2a: bfloat16
  [4, 8 heads per rank, 128] with the merged lse; the fused op: float32 8 x
  1024 (fused within the window, else its unfused path)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  from helpers import assert_residual_rmsnorm_matches, residual_rmsnorm_fn, residual_rmsnorm_inputs
  n, me = jax.device_count(), jax.process_index()
  digest = lambda *arrays: hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()  # noqa: E731
  local = lambda a, spec: jax.make_array_from_process_local_data(NamedSharding(mesh, spec), a)  # noqa: E731
  if op == "all_reduce":
    ours = _reducer(mesh, b12x_jax.all_reduce)
    return lambda: [_check(ours, mesh, rng, elems, "float32") for elems in (4096, 1 << 19)]
  if op == "dcp_a2a":
    merge = jax.jit(jax.shard_map(lambda o, l: b12x_jax.dcp_a2a(o, l, "x", return_lse=True), mesh=mesh,
                                  in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))

    def check_merge():
      got, got_lse, check = _merge_here(merge, mesh, rng, 4, 8, 128, empty=((0, 0, 0),))
      check()
      return [digest(got, got_lse)]
    return check_merge
  fused = residual_rmsnorm_fn(mesh)

  def check_fused():
    shards, residual, weight = residual_rmsnorm_inputs(rng, n, 8, 1024, "float32")
    normed, new_residual = (np.asarray(o.addressable_shards[0].data) for o in fused(
        local(shards[me:me + 1], P("x")), local(residual, P()), local(weight, P())))
    assert_residual_rmsnorm_matches(normed, new_residual, shards, residual, weight, 1e-6, "float32")
    return [digest(normed, new_residual)]
  return check_fused


def reprepare_mode(args) -> dict:
  """Executables of ``--op`` run, their channel is released and prepared
  again, three times over (DESIGN C16): the cached executables (on CUDA
  replayed from their graphs, with the pointers they were captured with)
  never touch freed memory and are right on every run, on the Lamport and
  the barrier paths (``--communicator``'s window and algorithm;
  _reprepare_check), outputs poisoned. Returns the hashes of the outputs,
  the calls taken (helpers.calls_taken) and the last epoch. The GPU rig
  runs it under compute-sanitizer."""
  import jax
  import numpy as np

  import b12x_jax
  from helpers import calls_taken
  b12x_jax.set_communicator(_communicator(args, poison_outputs=True))
  mesh = _mesh()
  comm = b12x_jax.get_communicator()
  check = _reprepare_check(args.op, mesh, np.random.default_rng(5))
  hashes = []
  with b12x_jax.channel("reprepared"):
    for _ in range(3):
      hashes += check() + check()
      comm.release("reprepared")
      comm.prepare(mesh, "x", channels=["reprepared"])
  b12x_jax.check_errors()
  return {"hashes": hashes, "taken": calls_taken(comm.decisions),
          "epoch": comm.stats("reprepared", jax.local_devices()[0])["epoch"]}


def independent_mode(args) -> dict:
  """32 calls of ``--op`` on one channel whose inputs do not depend on each
  other (helpers.independent_calls), 20 runs on fresh integer inputs, across
  processes (DESIGN C15), outputs poisoned. Returns how many of this
  process's results were wrong, and the calls taken (helpers.calls_taken)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  from helpers import calls_taken, independent_calls, independent_wrong, integer_shards
  b12x_jax.set_communicator(_communicator(args, poison_outputs=True))
  mesh, me, calls, elems, n = _mesh(), jax.process_index(), 32, 4096, jax.device_count()
  fn = jax.jit(jax.shard_map(independent_calls(calls, args.op), mesh=mesh, in_specs=P(None, "x"),
                             out_specs=P(None, "x"), check_vma=False))
  rng = np.random.default_rng(6)  # the same shards in every process
  wrong, runs = 0, 20
  with b12x_jax.channel("independent"):
    for _ in range(runs):
      shards = integer_shards(rng, calls, n, elems)
      x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(None, "x")), shards[:, me])
      got = np.asarray(fn(x).addressable_shards[0].data)
      wrong += independent_wrong(args.op, got[:, None], shards, ranks=[me])
  b12x_jax.check_errors()
  return {"wrong": wrong, "results": runs * calls, "taken": calls_taken(b12x_jax.get_communicator().decisions)}


def _skewed(v, rank):
  """``v``, after a chain of matmuls on ``rank`` only: the ranks reach what
  follows at different times."""
  import jax
  import jax.numpy as jnp

  def heavy(v):
    a = jnp.tile(v[:256], (256, 1)) * 1e-3
    for _ in range(30):
      a = jnp.tanh(a @ a.T)
    return v + 0 * a[0, 0]
  return jax.lax.cond(jax.lax.axis_index("x") == rank, heavy, lambda v: v, v)


def dispatch_order_mode(args) -> dict:
  """Calls that nothing but their order keeps apart (docs/DESIGN.md, "Call
  order"), on one channel, with equal shapes (so equal tags), across
  processes: (a) two executables dispatched alternately, 8 at a time
  without waiting, the one with matmuls before its call on rank 0 only;
  (b) one jitted function of four consecutive shard_maps of one call each,
  whose inputs do not depend on each other, the first after rank 0's
  matmuls, the third after rank 1's. 10 rounds on fresh integer inputs.
  Returns how many of this process's results were wrong."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  from helpers import integer_shards
  b12x_jax.set_communicator(_communicator(args))
  mesh, me, n, elems = _mesh(), jax.process_index(), jax.device_count(), 1024
  smap = lambda f: jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)  # noqa: E731
  skewed_call = jax.jit(smap(lambda v: b12x_jax.all_reduce(_skewed(v, 0), "x")))
  plain_call = jax.jit(smap(lambda v: b12x_jax.all_reduce(v, "x")))
  siblings = jax.jit(lambda x: [smap(lambda v: b12x_jax.all_reduce(_skewed(v, 0), "x"))(x[0]),
                                smap(lambda v: b12x_jax.all_reduce(v, "x"))(x[1]),
                                smap(lambda v: b12x_jax.all_reduce(_skewed(v, 1 % n), "x"))(x[2]),
                                smap(lambda v: b12x_jax.all_reduce(v, "x"))(x[3])])
  put = lambda rows: jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), rows)  # noqa: E731
  rng = np.random.default_rng(8)  # the same shards in every process
  wrong = results = 0
  with b12x_jax.channel("dispatch-order"):
    for _ in range(10):
      shards = integer_shards(rng, 12, n, elems)  # [12, n, elems]
      outs = [(f(put(shards[k, me])), k) for k, f in enumerate([skewed_call, plain_call] * 4)]
      together = siblings([put(shards[8 + k, me]) for k in range(4)])
      outs += [(got, 8 + k) for k, got in enumerate(together)]
      for got, k in outs:
        wrong += int((np.asarray(got.addressable_shards[0].data) != shards[k].sum(axis=0, dtype=np.float64)).any())
        results += 1
  b12x_jax.check_errors()
  return {"wrong": wrong, "results": results}


def late_start_mode(args) -> dict:
  """Process 1 reaches its first execution on a freshly prepared channel
  ``--late`` seconds after the others (compilation, weight loading), far
  beyond timeout_s: the first call waits up to setup_timeout_s instead
  (DESIGN C8), so every result is right; later calls are bounded by
  timeout_s again."""
  import jax
  import numpy as np

  import b12x_jax
  b12x_jax.set_communicator(_communicator(args, timeout_s=args.timeout, setup_timeout_s=args.setup_timeout))
  mesh = _mesh()
  comm = b12x_jax.get_communicator()
  comm.prepare(mesh, "x", channels=["late"])
  ours = _reducer(mesh, b12x_jax.all_reduce)
  rng = np.random.default_rng(8)
  if jax.process_index() == 1:
    time.sleep(args.late)
  start = time.monotonic()
  with b12x_jax.channel("late"):
    hashes = [_check(ours, mesh, rng, elems, "float32") for elems in (1024, 1 << 19) for _ in range(2)]
  b12x_jax.check_errors()
  return {"hashes": hashes, "seconds": time.monotonic() - start}


def settings_mode(args) -> dict:
  """Each process makes its own Communicator (``--communicators``: a JSON
  list of keyword arguments, one dict per process; the environment may
  differ too, and $B12X_TEST_BUILD poses as another build) and runs
  all_reduce on fresh 4 KiB shards. Returns the error
  it raised, or, after checking the values against float64, the path the
  call took and why; and the shared memory still mapped."""
  import jax
  import numpy as np

  import b12x_jax
  from b12x_jax import rendezvous
  if "B12X_TEST_BUILD" in os.environ:  # this process poses as another build of b12x_jax
    rendezvous.build_id = lambda: os.environ["B12X_TEST_BUILD"]
  mesh = _mesh()
  b12x_jax.set_communicator(_communicator(args, **json.loads(args.communicators)[jax.process_index()]))
  start = time.monotonic()
  try:
    with b12x_jax.channel("agreed"):
      _check(_reducer(mesh, b12x_jax.all_reduce), mesh, np.random.default_rng(5), 1024, "float32",
             roundings=jax.device_count())  # the psum path may round at every step
  except b12x_jax.B12xError as e:
    return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start,
            "mapped": _mapped_shm()}
  decision = b12x_jax.get_communicator().decisions[-1]
  return {"error": None, "path": decision.path, "reason": decision.reason, "mapped": _mapped_shm()}


def uneven_mode(args) -> dict:
  """Processes hold different numbers of devices ($B12X_TEST_LOCAL_DEVICES
  per process): the mesh takes each process's first, so its axis spans
  processes though it is no longer than some process's devices; or only
  the first $B12X_TEST_MESH_PROCESSES processes' (the others stay idle).
  Runs all_reduce on fresh 4 KiB shards; returns the path and the error,
  if any."""
  import jax
  import numpy as np
  from jax.sharding import Mesh

  import b12x_jax
  processes = int(os.environ.get("B12X_TEST_MESH_PROCESSES", jax.process_count()))
  if jax.process_index() >= processes:
    return {"idle": True}
  firsts = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(processes)]
  mesh = Mesh(np.array(firsts), ("x",))
  b12x_jax.set_communicator(_communicator(args))
  try:
    with b12x_jax.channel("uneven"):
      _check(_reducer(mesh, b12x_jax.all_reduce), mesh, np.random.default_rng(5), 1024, "float32")
  except b12x_jax.B12xError as e:
    return {"error": type(e).__name__, "message": str(e)}
  return {"error": None, "path": b12x_jax.get_communicator().decisions[-1].path}


def crossed_mode(args) -> dict:
  """Every process holds 2 devices; axis "x" pairs device i of process 0
  with device i of process 1: it spans processes though no longer than a
  process's devices. Runs all_reduce over "x" on fresh values with this
  process's ``--communicators`` entry; returns the error, or the path after
  checking the sums against float64."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  local = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(2)]
  mesh = Mesh(np.array(local).T, ("a", "x"))
  b12x_jax.set_communicator(_communicator(args, **json.loads(args.communicators)[jax.process_index()]))
  values = np.random.default_rng(11).standard_normal((2, 2, 256)).astype(np.float32)
  x = jax.make_array_from_callback(values.shape, NamedSharding(mesh, P("a", "x")), lambda index: values[index])
  fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("a", "x"),
                             out_specs=P("a")))
  try:
    with b12x_jax.channel("crossed"):
      out = fn(x)
      for shard in out.addressable_shards:
        want = values.astype(np.float64).sum(1, keepdims=True)[shard.index]
        np.testing.assert_allclose(np.asarray(shard.data), want, rtol=1e-6, atol=1e-5)
  except b12x_jax.B12xError as e:
    return {"error": type(e).__name__, "message": str(e)}
  return {"error": None, "path": b12x_jax.get_communicator().decisions[-1].path}


def stale_shm_mode(args) -> dict:
  """Before its first preparation each process leaves shared-memory names
  of its own pid behind, as a process that died with them would have (a pid
  is reused, e.g. in a restarted container sharing /dev/shm), then runs
  all_reduce on fresh shards. Returns the path it took and whether the
  stale names are still there (it must neither fail on them nor remove
  them)."""
  import jax
  import numpy as np

  import b12x_jax
  stale = [f"/dev/shm/b12x.{os.getpid()}.{n}.r{jax.process_index()}" for n in range(3)]
  for path in stale:
    with open(path, "wb"):
      pass
  try:
    mesh = _mesh()
    b12x_jax.set_communicator(_communicator(args))
    with b12x_jax.channel("stale-names"):
      _check(_reducer(mesh, b12x_jax.all_reduce), mesh, np.random.default_rng(6), 1024, "float32")
    path = b12x_jax.get_communicator().decisions[-1].path
    kept = all(os.path.exists(p) for p in stale)
  finally:
    for p in stale:
      if os.path.exists(p):
        os.unlink(p)
  return {"path": path, "kept": kept}


def two_hosts_mode(args) -> dict:
  """4 processes of a device each, 0 and 1 on one host, 2 and 3 on
  another (B12X_JAX_HOST_ID, set by the test); a mesh (dp across the hosts,
  tp within each): an all_reduce over dp (its groups span hosts: psum),
  then one over tp, checked against float64. Returns each call's path."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  devices = sorted(jax.devices(), key=lambda d: d.process_index)
  mesh = Mesh(np.array(devices, dtype=object).reshape(2, 2), ("dp", "tp"))  # dp: (0, 2), (1, 3); tp: (0, 1), (2, 3)
  b12x_jax.set_communicator(_communicator(args))
  rng = np.random.default_rng(9)
  full = rng.integers(-1000, 1000, size=(2, 2 * 256)).astype(np.float32)
  x = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("dp", "tp")), lambda index: full[index])
  paths = {}
  for axis, out_spec, want in (("dp", P(None, "tp"), full.sum(axis=0, keepdims=True)),
                               ("tp", P("dp", None), full.reshape(2, 2, 256).sum(axis=1))):
    fn = jax.jit(jax.shard_map(lambda v, a=axis: b12x_jax.all_reduce(v, a), mesh=mesh, in_specs=P("dp", "tp"),
                               out_specs=out_spec))
    with b12x_jax.channel("hosts"):
      got = fn(x)
    for shard in got.addressable_shards:
      assert np.array_equal(np.asarray(shard.data), want[shard.index]), (axis, shard.index)
    paths[axis] = b12x_jax.get_communicator().decisions[-1].path
  return {"paths": paths}


# The cases of drop_in mode and the path each must take.
DROP_IN_PATHS = {"grad": "b12x", "jvp": "b12x", "vmap_all_reduce": "b12x", "vmap_dcp_a2a": "b12x",
                 "vmap_fused": "b12x", "packed_pytree": "b12x", "tuple_of_axes": "psum", "axis_index_groups": "psum"}


def drop_in_mode(args) -> dict:
  """tests/test_drop_in.py's cases across processes (psum's drop-in): grad and
  jvp of all_reduce, vmap of all_reduce, dcp_a2a and the fused op (one call
  of the folded batches), a pytree of small leaves (packed calls), a tuple
  of axes and axis_index_groups (psum). Every result is checked against
  float64 here, with poisoned outputs; the b12x cases must lower to no XLA
  collective (the rig cannot run NCCL: every process is on GPU 0), and
  there the psum cases are only lowered. Returns each case's path
  (DROP_IN_PATHS), the cases checked against float64, and the hashes of the
  results every rank holds alike."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  from helpers import assert_residual_rmsnorm_matches, assert_sum_matches, attention_shards, residual_rmsnorm_inputs
  comm = _communicator(args, poison_outputs=True)
  b12x_jax.set_communicator(comm)
  mesh = _mesh()
  n, me = jax.device_count(), jax.process_index()
  rng = np.random.default_rng(15)  # the same inputs in every process
  paths, checked, hashes = {}, [], {}

  def shard_map(body, in_specs, out_specs, check_vma=True, on=mesh):
    return jax.jit(jax.shard_map(body, mesh=on, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))

  def place(host, spec=P("x"), on=mesh):  # this process's part of a global array
    return jax.make_array_from_process_local_data(NamedSharding(on, spec), host)

  def mine(results):  # this process's shard of each result, as NumPy
    return jax.tree.map(lambda r: np.asarray(r.addressable_shards[0].data), results)

  def each_rank(tree):  # a result of every rank, [1, ...] per rank under out_specs P("x")
    return jax.tree.map(lambda r: r[None], tree)

  def ran(case, fn, *inputs, op="all_reduce", invariant=()):
    """Records the path of ``case``'s last ``op`` and the hashes of its
    ``invariant`` results; a b12x case must lower to b12x calls only."""
    paths[case] = [d.path for d in comm.decisions if d.op == op][-1]
    if paths[case] == "b12x":
      text = fn.lower(*inputs).as_text()
      assert "stablehlo.all_reduce" not in text and "stablehlo.all_to_all" not in text, f"{case}: an XLA collective"
    checked.append(case)
    if invariant:
      hashes[case] = hashlib.sha256(b"".join(np.ascontiguousarray(r).tobytes() for r in invariant)).hexdigest()

  with b12x_jax.channel("mp_drop_in"):
    # grad and jvp: the total loss's gradient is sin(S) + 2 v_me cos(S) sum_q v_q with S = sum_q v_q**2.
    # check_vma=False: with it, the pvary of sin(S) transposes to jax's psum, which the rig cannot run.
    v, t = (rng.standard_normal((n, 256)).astype(np.float32) for _ in range(2))
    grad = shard_map(lambda u: jax.grad(lambda w: jnp.sum(jnp.sin(b12x_jax.all_reduce(w * w, "x")) * w))(u[0])[None],
                     P("x"), P("x"), check_vma=False)
    got = mine(grad(place(v[me:me + 1])))[0]
    s, v64 = (v.astype(np.float64) ** 2).sum(0), v.astype(np.float64)
    np.testing.assert_allclose(got, np.sin(s) + 2 * v64[me] * np.cos(s) * v64.sum(0), rtol=1e-4, atol=1e-4 * n)
    ran("grad", grad, place(v[me:me + 1]))
    jvp = shard_map(lambda u, w: each_rank(jax.jvp(lambda a: b12x_jax.all_reduce(a * a, "x"), (u[0],), (w[0],))),
                    (P("x"), P("x")), (P("x"), P("x")))
    primal, tangent = mine(jvp(place(v[me:me + 1]), place(t[me:me + 1])))
    assert_sum_matches(primal, v * v, "float32")
    assert_sum_matches(tangent, 2 * (v * t), "float32")
    ran("jvp", jvp, place(v[me:me + 1]), place(t[me:me + 1]), invariant=(primal, tangent))

    # vmap of all_reduce: 3 rows per rank, one call of [3, 64].
    x = rng.standard_normal((n, 3, 64)).astype(np.float32)
    vmapped = shard_map(lambda a: each_rank(jax.vmap(lambda row: b12x_jax.all_reduce(row, "x"))(a[0])), P("x"),
                        P("x"))
    got = mine(vmapped(place(x[me:me + 1])))
    assert_sum_matches(got.reshape(1, -1), x.reshape(n, -1), "float32")
    ran("vmap_all_reduce", vmapped, place(x[me:me + 1]), invariant=(got,))

    # vmap of dcp_a2a: 3 batches of B=2 per rank, one call of B=6; this rank's head shard of each.
    batches, batch, heads, dim = 3, 2, 2 * n, 64
    outs, lses, want, want_lse = attention_shards(rng, n, batches * batch, heads, dim, jnp.bfloat16)
    merge = jax.vmap(lambda a, b: b12x_jax.dcp_a2a(a, b, "x", return_lse=True))
    dcp = shard_map(lambda a, b: each_rank(merge(a[0], b[0])), (P("x"), P("x")), (P("x"), P("x")))
    o = place(outs[me].reshape(1, batches, batch, heads, dim))
    l = place(lses[me].reshape(1, batches, batch, heads))
    got, got_lse = mine(dcp(o, l))
    mine_heads = slice(me * heads // n, (me + 1) * heads // n)
    _assert_head_shard(got[0].reshape(batches * batch, heads // n, dim),
                       got_lse[0].reshape(batches * batch, heads // n), outs, want, want_lse, mine_heads)
    ran("vmap_dcp_a2a", dcp, o, l, op="dcp_a2a")

    # vmap of the fused op: 3 batches of 2 rows per rank, one fused call of [3, 2, hidden].
    rows, hidden = 2, 256
    shards, residual, weight = residual_rmsnorm_inputs(rng, n, batches * rows, hidden, "bfloat16")
    fused = jax.vmap(lambda a, r, w: b12x_jax.all_reduce_residual_rmsnorm(a, r, w, "x"), in_axes=(0, 0, None))
    fn = shard_map(lambda a, r, w: each_rank(fused(a[0], r, w)), (P("x"), P(), P()), (P("x"), P("x")))
    inputs = (place(shards[me].reshape(1, batches, rows, hidden)),
              place(residual.reshape(batches, rows, hidden), P()), place(weight, P()))
    normed, new_residual = mine(fn(*inputs))
    per_batch = shards.reshape(n, batches, rows, hidden)
    for b in range(batches):
      assert_residual_rmsnorm_matches(normed[:, b], new_residual[:, b], per_batch[:, b],
                                      residual.reshape(batches, rows, hidden)[b], weight, 1e-6, "bfloat16")
    ran("vmap_fused", fn, *inputs, op="all_reduce_residual_rmsnorm", invariant=(normed, new_residual))

    # A pytree of small leaves: one packed call per dtype (leaves of 140 and 18 bytes padded in).
    tree = {"a": rng.standard_normal((n, 5, 7)).astype(np.float32),
            "b": rng.standard_normal((n, 9)).astype(jnp.bfloat16),
            "c": rng.standard_normal((n, 4, 8)).astype(np.float32),
            "d": rng.standard_normal((n, 16)).astype(jnp.bfloat16)}
    packed = shard_map(lambda t: each_rank(b12x_jax.all_reduce(jax.tree.map(lambda a: a[0], t), "x")), P("x"),
                       P("x"))
    placed = {k: place(a[me:me + 1]) for k, a in tree.items()}
    got = mine(packed(placed))
    for k, a in tree.items():
      assert_sum_matches(got[k].reshape(1, -1), a.reshape(n, -1), np.dtype(a.dtype).name)
    packs = [d for d in comm.decisions[-2:] if "packed into one call" in d.reason]
    assert len(packs) == 2, comm.decisions[-2:]
    ran("packed_pytree", packed, placed, invariant=tuple(got[k] for k in sorted(got)))

    # psum's cases: a tuple of axes of a (1, n) mesh, and axis_index_groups.
    grid = jax.make_mesh((1, n), ("a", "x"))
    y = rng.standard_normal((n, 32)).astype(np.float32)
    groups = [list(range(n // 2)), list(range(n // 2, n))]  # (one group of the whole axis takes b12x's path)
    group = next(g for g in groups if me in g)
    for case, reduce, want_sum in (
        ("tuple_of_axes", lambda a: b12x_jax.all_reduce(a, ("a", "x")), y.astype(np.float64).sum(0)),
        ("axis_index_groups", lambda a: b12x_jax.all_reduce(a, "x", axis_index_groups=groups),
         y[group].astype(np.float64).sum(0))):
      fn = shard_map(lambda a: each_rank(reduce(a[0])), P(("a", "x")), P(("a", "x")), check_vma=False, on=grid)
      arg = place(y[me:me + 1], P(("a", "x")), on=grid)
      if args.platform == "gpu_rig":  # NCCL refuses two ranks on one GPU: the path only
        fn.lower(arg)
        paths[case] = comm.decisions[-1].path
        continue
      got = mine(fn(arg))[0]
      np.testing.assert_allclose(got, want_sum, rtol=1e-5, atol=1e-5)
      ran(case, fn, arg, invariant=(got,) if case == "tuple_of_axes" else ())
  b12x_jax.check_errors()
  return {"rank": me, "paths": paths, "checked": checked, "hashes": hashes}



def triton_mode(args) -> dict:
  """The Triton Lamport all_reduce across processes (docs/DESIGN.md, "Triton
  kernels"): float32 and bfloat16 at power-of-two sizes up to 256 KiB, twice
  each, against float64 with poisoned outputs, then the same inputs on the
  FFI kernel, which must give the same bits; Triton (float32) and FFI
  (float16) calls interleaved on one channel in one program; and Triton
  calls across the uint32 wrap of the counters (the hook, a barrier, then
  the calls). Returns the hashes, compared across processes by the test."""
  import jax
  import numpy as np

  import b12x_jax
  from b12x_jax import _compat
  from helpers import DTYPES, assert_sum_matches, random_shards
  mesh = _mesh()
  hashes: dict[str, list[str]] = {}
  for kernels in ("triton", "ffi"):
    comm = _communicator(args, kernels=kernels, poison_outputs=True)
    b12x_jax.set_communicator(comm)
    ours = _reducer(mesh, b12x_jax.all_reduce)
    rng = np.random.default_rng(0)  # the same shards for both kinds, in every process
    with b12x_jax.channel("tri"):
      for dtype, nbytes in itertools.product(("float32", "bfloat16"), (16, 4096, 65536, 256 << 10)):
        elems = nbytes // np.dtype(DTYPES[dtype]).itemsize
        hashes[f"{kernels}/{dtype}/{nbytes}"] = [_check(ours, mesh, rng, elems, dtype) for _ in range(2)]
    assert {d.kernel for d in comm.decisions} == {kernels}, comm.decisions
    b12x_jax.check_errors()
    comm.close()
  for key in [k for k in hashes if k.startswith("triton/")]:
    assert hashes[key] == hashes[key.replace("triton/", "ffi/")], key  # the FFI path's bits

  comm = _communicator(args, kernels="triton", poison_outputs=True)
  b12x_jax.set_communicator(comm)
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  def body(*xs):  # float32, float16, float32, float16: one channel, in this order
    return tuple(b12x_jax.all_reduce(x, "x") for x in xs)
  spec = (P("x"),) * 4
  mixed = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
  rng = np.random.default_rng(2)
  me, n = jax.process_index(), jax.device_count()
  with b12x_jax.channel("mixed"):
    for _ in range(3):
      shards = [random_shards(rng, n, 2048, DTYPES[d]) for d in ("float32", "float16", "float32", "float16")]
      outs = mixed(*[jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), s[me]) for s in shards])
      for got, s, d in zip(outs, shards, ("float32", "float16", "float32", "float16")):
        assert_sum_matches(np.asarray(got.addressable_shards[0].data)[None], s, d)
  assert [d.kernel for d in comm.decisions[:4]] == ["triton", "ffi", "triton", "ffi"], comm.decisions
  assert comm.stats("mixed", jax.local_devices()[0])["epoch"] == 12

  comm.prepare(mesh, "x", channels=["wrap"])
  comm._start_counters("wrap", 2**32 - 5)
  _compat.distributed_client().wait_at_barrier("b12x_jax_triton_wrap_counters", 60_000)
  ours = _reducer(mesh, b12x_jax.all_reduce)
  rng = np.random.default_rng(1)
  with b12x_jax.channel("wrap"):
    hashes["wrap"] = [_check(ours, mesh, rng, 1024, ("float32", "bfloat16")[i % 2]) for i in range(10)]
  b12x_jax.check_errors()
  return {"hashes": hashes, "epoch": comm.stats("wrap", jax.local_devices()[0])["epoch"]}


def loops_mode(args) -> dict:
  """Calls from inside a jax.lax.fori_loop on two channels, as a decode
  loop makes them (the rig tests' other modes run straight-line programs):
  each of 8 iterations an all_reduce of bfloat16 [1, 2, 128] and the fused
  op on 7 rows of 128 on "target", an all_reduce of 8 float32 (32 bytes) on
  "draft", with ``poison_outputs`` as --communicator says. The inputs are
  integers in [-2, 2], so every sum is exact in bfloat16 up to 8 ranks: the results summed
  over the iterations must equal float64 (the normed output within
  rounding). Returns the kernel kinds and the channels' epochs."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  comm = _communicator(args)
  b12x_jax.set_communicator(comm)
  mesh = _mesh()
  n, me, iterations = jax.device_count(), jax.process_index(), 8

  def body(x, y, residual, weight):
    def step(i, carry):
      sums, residuals, normed, small = carry
      scale = (i + 1).astype(jnp.float32)
      with b12x_jax.channel("target"):
        total = b12x_jax.all_reduce((x.astype(jnp.float32) * scale).astype(jnp.bfloat16), "x")
        out, new_residual = b12x_jax.all_reduce_residual_rmsnorm(
            (y.astype(jnp.float32) * scale).astype(jnp.bfloat16), residual, weight, "x")
      with b12x_jax.channel("draft"):
        small = small + b12x_jax.all_reduce(x[0, 0, :8].astype(jnp.float32) * scale, "x")
      return (sums + total.astype(jnp.float32), residuals + new_residual.astype(jnp.float32),
              normed + out.astype(jnp.float32), small)
    zeros = (jnp.zeros((1, 2, 128), jnp.float32), jnp.zeros((7, 128), jnp.float32), jnp.zeros((7, 128), jnp.float32),
             jnp.zeros((8,), jnp.float32))
    return jax.lax.fori_loop(0, iterations, step, zeros)

  fn = jax.jit(jax.shard_map(lambda x, y, r, w: body(x[0], y[0], r, w), mesh=mesh,
                             in_specs=(P("x"), P("x"), P(), P()), out_specs=P(), check_vma=False))
  rng = np.random.default_rng(3)  # the same inputs in every process
  xs = rng.integers(-2, 3, (n, 1, 2, 128)).astype(np.float32)
  ys = rng.integers(-2, 3, (n, 7, 128)).astype(np.float32)
  residual = rng.integers(-2, 3, (7, 128)).astype(np.float32)
  weight = (1 + 0.1 * rng.standard_normal(128)).astype(jnp.bfloat16)
  local = lambda a, spec: jax.make_array_from_process_local_data(NamedSharding(mesh, spec), a)  # noqa: E731
  out = fn(local(xs[me:me + 1].astype(jnp.bfloat16), P("x")), local(ys[me:me + 1].astype(jnp.bfloat16), P("x")),
           local(residual.astype(jnp.bfloat16), P()), local(weight, P()))
  sums, residuals, normed, small = (np.asarray(o.addressable_shards[0].data, np.float64) for o in out)
  scales = np.arange(1, iterations + 1, dtype=np.float64)
  assert np.array_equal(sums, scales.sum() * xs.sum(0)), np.abs(sums - scales.sum() * xs.sum(0)).max()
  assert np.array_equal(small, scales.sum() * xs.sum(0)[0, 0, :8])
  want_normed = np.zeros((7, 128))
  want_residuals = np.zeros((7, 128))
  for s in scales:
    r = s * ys.sum(0) + residual
    want_residuals += r
    want_normed += r / np.sqrt(np.mean(r * r, -1, keepdims=True) + 1e-6) * weight.astype(np.float64)
  assert np.array_equal(residuals, want_residuals), np.abs(residuals - want_residuals).max()
  assert np.allclose(normed, want_normed, rtol=2e-2, atol=iterations * 2e-2), np.abs(normed - want_normed).max()
  b12x_jax.check_errors()
  kinds = sorted({f"{d.op} {d.kernel}" for d in comm.decisions if d.path == "b12x"})
  return {"kinds": kinds, "epochs": [comm.stats(ch, jax.local_devices()[0])["epoch"] for ch in ("target", "draft")]}


def same_program_mode(args) -> dict:
  """Lowers for CUDA (on CPU: the channels are CPU groups, the addresses
  theirs) a program of two channels with Triton and FFI calls, and returns
  the hash of its text and the rows of the baked address tables: every
  process must lower the same program (DESIGN "Call order", "Triton
  kernels"), with every device's row in its table, though the processes'
  setup_timeout_s (each device's first-call bound, in its row) differ."""
  import re

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax._src.pallas.triton import pallas_call_registration
  from jax.experimental.pallas import triton as plt
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: plt.get_gpu_info_from_version(plt.GpuVersion.H200)
  comm = _communicator(args, kernels="triton", setup_timeout_s=30.0 + jax.process_index())
  b12x_jax.set_communicator(comm)
  mesh = _mesh()

  def body(x, y):
    with b12x_jax.channel("draft"):
      d = b12x_jax.all_reduce(y.astype(jnp.bfloat16), "x")
    return b12x_jax.all_reduce(x, "x"), d, b12x_jax.all_reduce(x.astype(jnp.float16), "x")
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"),) * 3))
  spec = jax.ShapeDtypeStruct((jax.device_count() * 1024,), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  with b12x_jax.channel("target"):
    text = fn.trace(spec, spec).lower(lowering_platforms=("cuda",)).as_text()
  tables = [np.frombuffer(bytes.fromhex(h), np.int32).reshape(-1, 64)
            for h in re.findall(r'dense<"0x([0-9A-F]+)"> : tensor<%dx64xi32>' % jax.device_count(), text)]
  return {"program": hashlib.sha256(text.encode()).hexdigest(), "kernels": [d.kernel for d in comm.decisions],
          "tables": len(tables),
          "rows_filled": [[bool(row.any()) for row in table] for table in tables]}


MODES = {"after_failure": after_failure_mode, "stale_replay": stale_replay_mode, "misplaced_export": misplaced_export_mode, "reuse_cycles": reuse_cycles_mode, "dies_preparing": dies_preparing_mode,
         "capacity_edge": capacity_edge_mode, "loops": loops_mode, "same_program": same_program_mode, "drop_in": drop_in_mode, "all_reduce": all_reduce_mode, "dcp": dcp_mode, "order": order_mode, "failed_prepare": failed_prepare_mode, "small_shm": small_shm_mode, "met_apart": met_apart_mode, "threads_trace": threads_trace_mode, "slow_reset": slow_reset_mode,
         "never_joins": never_joins_mode, "close_twice": close_twice_mode, "throwaway": throwaway_mode,
         "exit_pending": exit_pending_mode, "close_after_peer_died": close_after_peer_died_mode,
         "elsewhere": elsewhere_mode, "killed_peer": killed_peer_mode, "settings": settings_mode,
         "residual_rmsnorm": residual_rmsnorm_mode, "never_calls": never_calls_mode, "mismatch": mismatch_mode, "reprepare": reprepare_mode,
         "independent": independent_mode, "dispatch_order": dispatch_order_mode, "late_start": late_start_mode,
         "wrap": wrap_mode, "two_hosts": two_hosts_mode, "stale_shm": stale_shm_mode, "uneven": uneven_mode, "crossed": crossed_mode,
         "triton": triton_mode}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("mode", choices=sorted(MODES))
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--platform", default="cpu", choices=["cpu", "gpu", "gpu_rig"])
  parser.add_argument("--setup-timeout", type=float, default=3.0)
  parser.add_argument("--cycles", type=int, default=30)  # reuse_cycles
  parser.add_argument("--timeout", type=float, default=2.0)
  parser.add_argument("--late", type=float, default=15.0)
  parser.add_argument("--communicator", default="{}")  # every process's Communicator arguments (JSON)
  parser.add_argument("--communicators", default="[]")  # settings mode: one process's each, over --communicator
  parser.add_argument("--configs", default="[{}]")  # all_reduce mode: Communicators run in turn
  parser.add_argument("--op", default="all_reduce", choices=["all_reduce", "dcp_a2a", "residual_rmsnorm",  # never_calls
                                                             "all_reduce_site", "all_reduce_dtype",  # and mismatch
                                                             "residual_rmsnorm_dtype", "dcp_a2a_lse_base"])
  parser.add_argument("--wrap", action="store_true")  # residual_rmsnorm, dcp modes: start the counters 5 calls before the wrap
  args = parser.parse_args()
  sys.path.insert(0, os.path.dirname(__file__))
  _setup(args)
  result = MODES[args.mode](args)
  print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
