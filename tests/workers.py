"""Subprocess workers for tests that may hang or need their own XLA flags.

Run as ``python tests/workers.py MODE --platform cpu|gpu [--devices N]``;
prints one line ``RESULT <json>`` and exits 0 when its checks passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _setup(platform: str, devices: int, xla_flags: str = "") -> None:
  flags = [xla_flags] if xla_flags else []
  if platform == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  os.environ["XLA_FLAGS"] = " ".join(flags + [os.environ.get("XLA_FLAGS", "")]).strip()


def timeout_mode(args) -> dict:
  """Rank 0 calls ``args.op`` (all_reduce or dcp_a2a), rank 1 never joins:
  the error must name the channel, rank, missing peer and epoch, within the
  timeout."""
  import jax
  import numpy as np
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  b12x_jax.set_communicator(b12x_jax.Communicator(timeout_s=args.timeout, lamport_bytes=args.lamport_bytes))
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])

  if args.op == "all_reduce":
    def lonely(x):
      return b12x_jax.all_reduce(x, "x")
    x = np.ones((2 * 256,), np.float32)
  else:  # out [B, H, D] bfloat16 from the float input; each rank keeps H/2 heads, as the skipping branch does
    def lonely(x):
      out = b12x_jax.dcp_a2a(x.astype(jax.numpy.bfloat16), jax.numpy.zeros(x.shape[:2], np.float32), "x")
      return out.astype(x.dtype)
    x = np.ones((2 * 4, 8, 64), np.float32)

  def body(x):
    joined = jax.lax.axis_index("x") == 0
    skip = (lambda v: v) if args.op == "all_reduce" else (lambda v: v[:, : v.shape[1] // 2])
    return jax.lax.cond(joined, lonely, skip, x)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("x")))
  start = time.monotonic()
  messages = []
  with b12x_jax.channel("lonely"):
    for _ in range(2):  # the second call must fail fast: the channel is poisoned
      try:
        fn(x).block_until_ready()
        b12x_jax.check_errors()
      except Exception as e:  # noqa: BLE001 - the test inspects the text
        messages.append(str(e))
  return {"messages": messages, "seconds": time.monotonic() - start}


def graphs_mode(args) -> dict:
  """17 all-reduces in one executable, run `runs` times on fresh inputs:
  12 small ones (the Lamport path on CUDA) and 5 just above the 1 MiB Lamport
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


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("mode", choices=["timeout", "graphs", "dcp"])
  parser.add_argument("--platform", default="cpu")
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--timeout", type=float, default=1.0)
  parser.add_argument("--runs", type=int, default=200)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--lamport-bytes", type=int, default=1 << 20)
  parser.add_argument("--op", choices=["all_reduce", "dcp_a2a"], default="all_reduce")
  parser.add_argument("--xla-flags", default="")
  args = parser.parse_args()
  _setup(args.platform, args.devices, args.xla_flags)
  result = {"timeout": timeout_mode, "graphs": graphs_mode, "dcp": dcp_mode}[args.mode](args)
  print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
