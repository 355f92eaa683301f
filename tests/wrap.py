"""Calls across the uint32 wrap of a channel's counters (docs/DESIGN.md,
"Wrap"; DESIGN C14), shared by the CPU and GPU tests: the channel starts
just below 2**32 through the test hook (Communicator._start_counters), then
every path runs on it, interleaved, each call on fresh random inputs and
checked against float64 NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import b12x_jax
from helpers import assert_merge_matches, assert_residual_rmsnorm_matches, assert_sum_matches, attention_shards

START = 2**32 - 5
# With the Communicator of run_across_wrap: a Lamport all_reduce, one above
# the window (the barrier algorithm asked for; 3 packs more than a multiple
# of 4 ranks' shards), a fused call within the Lamport cells, and DCP merges
# within the Lamport cells and above them (4 KiB rows: the barrier protocol).
LAMPORT_BYTES = 16 * 1024
SMALL_ELEMS = 1024                  # 4 KiB of float32
LARGE_ELEMS = 8 * 1024 + 12         # 32 KiB + 48 bytes
ROWS, HIDDEN = 8, 64                # 2 KiB of float32, 256-byte rows
DCP = dict(batch=2, heads=8, dim=64)
DCP_LARGE = dict(batch=2, heads=8, dim=2048)


def communicator_options(algorithm: str) -> dict:
  return dict(poison_outputs=True, lamport_bytes=LAMPORT_BYTES, algorithm=algorithm)


def run_across_wrap(comm, mesh, channel: str, calls: int, seed: int, start: int = START) -> dict:
  """Prepares ``channel`` on ``mesh`` (axis "x"), starts its counters at
  ``start`` and runs ``calls`` rounds of [Lamport all_reduce, barrier
  all_reduce, fused op, Lamport dcp_a2a, barrier dcp_a2a] on it. Returns what the paths and stats say."""
  n = mesh.devices.size
  rng = np.random.default_rng(seed)
  comm.prepare(mesh, "x", channels=[channel])
  comm._start_counters(channel, start)
  sharded = NamedSharding(mesh, P("x"))

  reduce = jax.jit(jax.shard_map(lambda x: b12x_jax.all_reduce(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))

  def fused_body(x, residual, weight):
    normed, new_residual = b12x_jax.all_reduce_residual_rmsnorm(x[0], residual, weight, "x")
    return normed[None], new_residual[None]
  fused = jax.jit(jax.shard_map(fused_body, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=(P("x"), P("x")),
                                check_vma=False))

  def dcp_body(out, lse):
    merged, merged_lse = b12x_jax.dcp_a2a(out[0], lse[0], "x", return_lse=True)
    return merged[None], merged_lse[None]
  dcp = jax.jit(jax.shard_map(dcp_body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))

  paths = set()
  with b12x_jax.channel(channel):
    for _ in range(calls):
      for elems in (SMALL_ELEMS, LARGE_ELEMS):
        shards = rng.standard_normal((n, elems)).astype(np.float32)
        got = np.asarray(reduce(jax.device_put(shards.reshape(-1), sharded))).reshape(n, elems)
        paths.add(comm.decisions[-1].path)
        assert_sum_matches(got, shards, "float32")
      x = rng.standard_normal((n, ROWS, HIDDEN)).astype(np.float32)
      residual = rng.standard_normal((ROWS, HIDDEN)).astype(np.float32)
      weight = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
      normed, new_residual = fused(jax.device_put(x, sharded), residual, weight)
      paths.add(comm.decisions[-1].path)
      assert_residual_rmsnorm_matches(np.asarray(normed), np.asarray(new_residual), x, residual, weight, 1e-6,
                                      "float32")
      for shape in (DCP, DCP_LARGE):
        outs, lses, want_out, want_lse = attention_shards(rng, n, shape["batch"], shape["heads"], shape["dim"],
                                                          jnp.bfloat16)
        merged, merged_lse = dcp(jax.device_put(outs, sharded), jax.device_put(lses, sharded))
        paths.add(comm.decisions[-1].path)
        assert_merge_matches(np.asarray(merged, np.float32), np.asarray(merged_lse), outs, want_out, want_lse,
                             "bfloat16")
  b12x_jax.check_errors()
  dcp_protocols = ["lamport" if "; lamport (" in d.reason else "barrier" for d in comm.decisions
                   if d.op == "dcp_a2a" and d.channel == channel]  # DCP, then DCP_LARGE (each traced once)
  return {"paths": sorted(paths), "dcp_protocols": dcp_protocols,
          "epoch": comm.stats(channel, mesh.devices.flat[0])["epoch"]}


def expected_epoch(algorithm: str, calls: int, start: int = START) -> int:
  """What stats()["epoch"] (barriers + Lamport calls, mod 2**32) reads after
  run_across_wrap: both counters started at ``start``."""
  barriers = calls * ((2 if algorithm == "two_shot" else 1) + 1)  # the large all_reduce and dcp_a2a
  lamport = calls * 3                                              # the small all_reduce and dcp_a2a, the fused op
  return (2 * start + barriers + lamport) % 2**32
