"""Decode attention with the KV cache split across ranks, merged by b12x_jax.dcp_a2a.

Decode context parallelism (DCP): the query of each decode step [B, H, D] is
replicated on every rank, the KV cache positions are split contiguously across
the ranks, and each rank computes partial attention (out [B, H, D] and lse
[B, H]) over its own shard. Rows have their own valid length, so some rows have
no key at all on some ranks: lse is -inf there (and out NaN, which the merge
never reads). dcp_a2a merges the partials and hands each rank its head shard
[B, H/N, D]. The example checks out and lse against full attention in float64
NumPy, then times a chain of decode steps against the same merge through
jax.lax.all_to_all (dcp_a2a's fallback, forced with policy "psum"). Times on
emulated CPU devices show the protocol runs, not how fast it is.

  python examples/dcp_decode.py                 # CPU devices unless >= 2 GPUs
  python examples/dcp_decode.py --batch 8 --heads 32 --head-dim 128 --kv-len 8192
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Printed next to timings taken on emulated CPU devices, and shown by --help.
CPU_TIMINGS = ("On CPU devices the timings measure the emulation (XLA:CPU devices and the host-memory backend "
               "sharing this machine's cores), not the library's speed on GPUs.")
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=CPU_TIMINGS,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--devices", type=int, default=2, help="context-parallel ranks")
parser.add_argument("--batch", type=int, default=4, help="decode rows B")
parser.add_argument("--heads", type=int, default=16, help="attention heads H (a multiple of --devices)")
parser.add_argument("--head-dim", type=int, default=128, help="head dimension D")
parser.add_argument("--kv-len", type=int, default=256, help="KV cache positions in total, split across ranks")
parser.add_argument("--steps", type=int, default=16, help="chained decode steps per timed executable")
parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="dtype of q, k, v and out")
parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
args = parser.parse_args()
# Emulated CPU devices, used only when fewer than --devices GPUs are present.
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={max(args.devices, 2)}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import b12x_jax  # noqa: E402

AXIS = "cp"
REPEATS = 10


def partial_attention(q, k, v, valid):
  """Attention of q [B, H, D] over this rank's keys k, v [B, S, H, D] where
  valid [B, S]: out [B, H, D] in q's dtype and lse [B, H] fp32 (-inf, and out
  NaN, for a row with no valid key)."""
  scores = jnp.einsum("bhd,bshd->bhs", q, k, preferred_element_type=jnp.float32) / np.sqrt(q.shape[-1])
  scores = jnp.where(valid[:, None, :], scores, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1)
  probs = jnp.exp(scores - lse[..., None]).astype(q.dtype)
  return jnp.einsum("bhs,bshd->bhd", probs, v, preferred_element_type=jnp.float32).astype(q.dtype), lse


def build(mesh, steps: int):
  """A jitted chain of `steps` decode steps. Each step's query is the previous
  step's merged output tiled over the heads, so XLA cannot merge or drop the
  steps (steps > 1 are for timing only: the query then differs per rank)."""
  def shard(q, k, v, lengths):
    local = k.shape[1]
    positions = jax.lax.axis_index(AXIS) * local + jnp.arange(local)  # contiguous split of the cache
    valid = positions[None, :] < lengths[:, None]
    for _ in range(steps):
      out, lse = partial_attention(q, k, v, valid)
      merged, merged_lse = b12x_jax.dcp_a2a(out, lse, AXIS, return_lse=True)
      q = jnp.tile(merged, (1, args.devices, 1))
    return merged, merged_lse

  kv_spec = P(None, AXIS, None, None)
  return jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(P(), kv_spec, kv_spec, P()),
                               out_specs=(P(None, AXIS, None), P(None, AXIS)), check_vma=False))


def reference(q, k, v, lengths):
  """Full attention over the whole cache in float64: out [B, H, D], lse [B, H]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  scores = np.einsum("bhd,bshd->bhs", q, k) / np.sqrt(q.shape[-1])
  scores = np.where(np.arange(k.shape[1])[None, None, :] < lengths[:, None, None], scores, -np.inf)
  m = scores.max(-1, keepdims=True)
  lse = m[..., 0] + np.log(np.exp(scores - m).sum(-1))
  return np.einsum("bhs,bshd->bhd", np.exp(scores - lse[..., None]), v), lse


def run(mesh, inputs, want_out, want_lse, label: str) -> float:
  """Checks one step against the reference, then returns seconds per step."""
  with b12x_jax.channel("decode"):
    out, lse = jax.block_until_ready(build(mesh, 1)(*inputs))
    path = b12x_jax.get_communicator().decisions[-1].path
    chain = build(mesh, args.steps)
    jax.block_until_ready(chain(*inputs))  # compile
    times = []
    for _ in range(REPEATS):  # one execution at a time: XLA:CPU can hang on queued multi-device runs
      start = time.perf_counter()
      jax.block_until_ready(chain(*inputs))
      times.append(time.perf_counter() - start)
  b12x_jax.check_errors()
  out_err = np.abs(np.asarray(out, np.float64) - want_out).max() / np.abs(want_out).max()
  lse_err = np.abs(np.asarray(lse, np.float64) - want_lse).max() / np.abs(want_lse).max()
  if not (out_err < 2e-2 and lse_err < 1e-4):
    sys.exit(f"{label}: relative error out {out_err:.1e}, lse {lse_err:.1e} vs float64 full attention")
  seconds = float(np.median(times)) / args.steps
  print(f"{label:20s}: {seconds * 1e6:9.1f} us/step (path {path}); relative error out {out_err:.1e}, "
        f"lse {lse_err:.1e}")
  return seconds


def main() -> None:
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  devices = gpus if len(gpus) >= args.devices else jax.devices("cpu")
  n, b, h, d, s = args.devices, args.batch, args.heads, args.head_dim, args.kv_len
  if h % n or s % n:
    sys.exit("--heads and --kv-len must divide by --devices")
  mesh = jax.make_mesh((n,), (AXIS,), devices=devices[:n])
  dtype = jnp.dtype(args.dtype)

  rng = np.random.default_rng(args.seed)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((b, h, d), (b, s, h, d), (b, s, h, d)))
  # Row 0 has a single key (every rank but 0 holds none of it), the last row
  # the whole cache, the others a random length.
  lengths = rng.integers(1, s + 1, size=b).astype(np.int32)
  lengths[0], lengths[-1] = 1, s
  empty = int(sum((lengths <= r * (s // n)).sum() for r in range(n)))
  print(f"mesh: {n} x {devices[0].platform}; B={b} H={h} D={d} {args.dtype}, {s} cached positions "
        f"({s // n} per rank), {empty} of {b * n} (row, rank) shards empty, {args.steps} steps per executable")

  kv_sharding = NamedSharding(mesh, P(None, AXIS, None, None))
  inputs = (jax.device_put(q, NamedSharding(mesh, P())), jax.device_put(k, kv_sharding),
            jax.device_put(v, kv_sharding), jax.device_put(jnp.asarray(lengths), NamedSharding(mesh, P())))
  want_out, want_lse = reference(q, k, v, lengths)

  b12x = run(mesh, inputs, want_out, want_lse, "b12x_jax.dcp_a2a")
  # Policy "psum" sends every collective to its plain-JAX path (all_to_all for
  # dcp_a2a); the policy is read at trace time, so build() traces afresh.
  b12x_jax.get_communicator().close()
  b12x_jax.set_communicator(b12x_jax.Communicator(policy="psum"))
  baseline = run(mesh, inputs, want_out, want_lse, "jax.lax.all_to_all")
  print(f"all_to_all / b12x: {baseline / b12x:.2f}x per decode step")
  if devices[0].platform == "cpu":
    print(CPU_TIMINGS)
  print("dcp decode OK")


if __name__ == "__main__":
  main()
