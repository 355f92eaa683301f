"""Quickstart: b12x_jax.all_reduce inside jax.jit + shard_map, on two channels.

Uses the GPUs when at least two are present, otherwise emulated CPU devices.
Checks every result against NumPy and prints what ran where.

  python examples/quickstart.py [--devices N]
"""

from __future__ import annotations

import argparse

import _runner

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--devices", type=int, default=2, help="ranks on the mesh axis")
args = parser.parse_args()
if args.devices < 1 or 1024 % args.devices:
  parser.error(f"--devices={args.devices} must divide 1024, the contraction the ranks split")
# Emulated CPU devices, used only when fewer than two GPUs are present.
_runner.emulate_cpu_devices(max(args.devices, 2))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import b12x_jax  # noqa: E402


def main() -> None:
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  devices = gpus if len(gpus) >= args.devices else jax.devices("cpu")
  n = args.devices
  mesh = jax.make_mesh((n,), ("tp",), devices=devices[:n])
  print(f"mesh: {n} x {devices[0].platform} devices")

  # A row-parallel matmul: each rank holds a slice of the contraction, the
  # all-reduce sums the partial products (what a tensor-parallel layer does).
  @jax.jit
  def layer(x, w):
    def shard(x, w):
      return b12x_jax.all_reduce(x @ w, "tp")
    return jax.shard_map(shard, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P())(x, w)

  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 1024)).astype(np.float32)
  w = rng.standard_normal((1024, 512)).astype(np.float32) / 32
  xs = jax.device_put(jnp.asarray(x, jnp.bfloat16), NamedSharding(mesh, P(None, "tp")))
  ws = jax.device_put(jnp.asarray(w, jnp.bfloat16), NamedSharding(mesh, P("tp", None)))
  want = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) @ np.asarray(jnp.asarray(w, jnp.bfloat16), np.float64)

  comm = b12x_jax.get_communicator()

  def decision(name):  # a call of a cached executable records none: the last of the channel's tracing
    return next(d for d in reversed(comm.decisions) if d.channel == name)

  for name in ("target", "draft", "target"):
    with b12x_jax.channel(name):  # same function, separate channel and executable per name
      got = np.asarray(layer(xs, ws), np.float64)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 2e-2, f"channel {name}: relative error {err}"
    print(f"channel {name:7s}: max relative error {err:.1e}, path {decision(name).path}")
  b12x_jax.check_errors()
  for name in ("target", "draft"):
    if name in comm.prepared_channels():  # not where every call took the psum path (B12X_JAX_POLICY=psum)
      calls = comm.stats(name, mesh.devices.flat[0])["epoch"]
      print(f"channel {name:7s}: {calls} call{'s' * (calls != 1)} on rank 0")
    else:
      print(f"channel {name:7s}: no b12x call ({decision(name).reason})")
  print("quickstart OK")


if __name__ == "__main__":
  main()
