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
  """Rank 0 calls all_reduce, rank 1 never joins: the error must name the
  channel, rank, missing peer and epoch, within the timeout."""
  import jax
  import numpy as np
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  b12x_jax.set_communicator(b12x_jax.Communicator(timeout_s=args.timeout))
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])

  def body(x):
    joined = jax.lax.axis_index("x") == 0
    return jax.lax.cond(joined, lambda v: b12x_jax.all_reduce(v, "x"), lambda v: v, x)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  x = jax.device_put(np.ones(2 * 256, np.float32), jax.sharding.NamedSharding(mesh, P("x")))
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
  """17 all-reduces in one executable, run `runs` times on fresh inputs."""
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
  sizes = [256 * (i + 1) for i in range(ops)]
  with b12x_jax.channel("graphs"):
    for _ in range(args.runs):
      shards = [rng.standard_normal((n, s)).astype(np.float32) for s in sizes]
      outs = fn(*[jax.device_put(s.reshape(-1), jax.sharding.NamedSharding(mesh, P("x"))) for s in shards])
      for s, out in zip(shards, outs):
        assert_sum_matches(np.asarray(out).reshape(n, -1), s, "float32")
  b12x_jax.check_errors()
  epoch = b12x_jax.get_communicator().stats("graphs", jax.devices()[0])["epoch"]
  return {"epoch": epoch, "expected": ops * args.runs}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("mode", choices=["timeout", "graphs"])
  parser.add_argument("--platform", default="cpu")
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--timeout", type=float, default=1.0)
  parser.add_argument("--runs", type=int, default=200)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--xla-flags", default="")
  args = parser.parse_args()
  _setup(args.platform, args.devices, args.xla_flags)
  result = {"timeout": timeout_mode, "graphs": graphs_mode}[args.mode](args)
  print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
