"""Decode attention with the KV cache split across ranks, merged by b12x_jax.dcp_a2a, in one jitted loop.

Decode context parallelism (DCP): the KV cache positions are split
contiguously across the ranks, and every decode step's query, key and value
[B, H, D] are known on every rank. Each step (a lax.scan over --steps steps in
one jitted program) appends the step's key and value to the rank that owns
the row's next position, lets every rank attend over its own shard (partial out
[B, H, D] and lse [B, H]), and merges the partials with dcp_a2a, which hands
each rank its head shard [B, H/N, D]. Rows have their own length, so some
(row, rank) shards hold no key at all: lse is -inf there (and out NaN, which
the merge never reads). Every run checks every step's out and lse against full
attention in float64 NumPy, and times the same loop with the merge written as
jax.lax.all_to_all + a jnp merge, and with no merge (each rank keeps its own
partials: timing only), in the same run.

  python examples/dcp_decode.py                 # 2 CPU devices unless >= 2 GPUs
  python examples/dcp_decode.py --batch 8 --heads 32 --head-dim 128 --kv-len 8192
  python examples/dcp_decode.py --processes 2 --shared-gpu   # 2 processes on GPU 0 (start MPS first)
"""

from __future__ import annotations

import argparse
import sys
import time

import _runner

# Printed next to timings taken on emulated CPU devices, and shown by --help.
CPU_TIMINGS = ("On CPU devices the timings measure the emulation (XLA:CPU devices and the host-memory backend "
               "sharing this machine's cores), not the library's speed on GPUs.")
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=CPU_TIMINGS,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--devices", type=int, default=2, help="context-parallel ranks")
parser.add_argument("--batch", type=int, default=4, help="decode rows B")
parser.add_argument("--heads", type=int, default=16, help="attention heads H (a multiple of --devices)")
parser.add_argument("--head-dim", type=int, default=128, help="head dimension D")
parser.add_argument("--kv-len", type=int, default=256, help="KV cache positions per row, split across ranks")
parser.add_argument("--steps", type=int, default=16, help="decode steps in the jitted loop")
parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="dtype of q, k, v and out")
parser.add_argument("--repeats", type=int, default=10, help="timed executions per merge (the median is shown)")
parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
parser.add_argument("--plot", metavar="PATH", help="write a PNG of the timings (needs matplotlib)")
_runner.add_arguments(parser)
args = parser.parse_args()
# Emulated CPU devices, used only when fewer than --devices GPUs are present.
_runner.emulate_cpu_devices(_runner.host_devices(args))
_runner.launch_or_join(args)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import b12x_jax  # noqa: E402

AXIS = "cp"
F32 = jnp.float32
CACHE_SPEC = P(None, AXIS, None, None)  # [row, position, head, head_dim]: contiguous positions per rank


def partial_attention(q, k, v, valid):
  """Attention of q [B, H, D] over this rank's keys k, v [B, S, H, D] where
  valid [B, S]: out [B, H, D] in q's dtype and lse [B, H] fp32 (-inf, and out
  NaN, for a row with no valid key)."""
  scores = jnp.einsum("bhd,bshd->bhs", q, k, preferred_element_type=F32) / np.sqrt(q.shape[-1])
  scores = jnp.where(valid[:, None, :], scores, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1)
  probs = jnp.exp(scores - lse[..., None]).astype(q.dtype)
  return jnp.einsum("bhs,bshd->bhd", probs, v, preferred_element_type=F32).astype(q.dtype), lse


def merge_all_to_all(out, lse):
  """dcp_a2a's result the plain way: rank p receives every rank's partials
  for p's head shard (jax.lax.all_to_all), then weighs them by their lse."""
  n = jax.lax.axis_size(AXIS)
  batch, heads, dim = out.shape
  outs = jax.lax.all_to_all(out.reshape(batch, n, heads // n, dim).swapaxes(0, 1), AXIS, 0, 0)  # [source, B, h, D]
  lses = jax.lax.all_to_all(lse.reshape(batch, n, heads // n).swapaxes(0, 1), AXIS, 0, 0)
  finite = jnp.isfinite(lses)  # an empty shard (-inf) weighs 0 and its NaN out is not read
  m = jnp.max(jnp.where(finite, lses, -jnp.inf), axis=0)  # finite: every row has a key on some rank
  weights = jnp.where(finite, jnp.exp(jnp.where(finite, lses, 0.0) - m), 0.0)
  total = weights.sum(0)
  merged = jnp.where(finite[..., None], weights[..., None] * outs.astype(F32), 0.0).sum(0) / total[..., None]
  return merged.astype(out.dtype), m + jnp.log(total)


def own_heads(out, lse):
  """No merge: this rank's head shard of its own partials (timing only)."""
  shard = out.shape[1] // jax.lax.axis_size(AXIS)
  start = jax.lax.axis_index(AXIS) * shard
  return (jax.lax.dynamic_slice_in_dim(out, start, shard, axis=1),
          jax.lax.dynamic_slice_in_dim(lse, start, shard, axis=1))


def merge_b12x(out, lse):
  return b12x_jax.dcp_a2a(out, lse, AXIS, return_lse=True)


# "b12x-triton": b12x's merge under a Communicator(kernels="triton") (GPUs only).
MERGES = {"b12x": merge_b12x, "b12x-triton": merge_b12x, "all_to_all": merge_all_to_all, "none": own_heads}


def decode(q, k_new, v_new, k_cache, v_cache, lengths, merge):
  """The decode steps on one rank: step t appends k_new[t], v_new[t] [B, H, D]
  at each row's position lengths + t, on the rank that owns it, and attends
  q[t] over positions <= that one. Returns the merged out [steps, B, H/N, D]
  and lse [steps, B, H/N] of this rank's heads, and the updated cache shard."""
  batch, local = k_cache.shape[:2]
  first = jax.lax.axis_index(AXIS) * local  # this rank's first position
  rows = jnp.arange(batch)

  def step(cache, per_step):
    k_cache, v_cache = cache
    q, k, v, t = per_step
    position = lengths + t  # [B]: the new token's position, per row
    slot = jnp.clip(position - first, 0, local - 1)
    owned = ((position - first >= 0) & (position - first < local))[:, None, None]
    # Rows this rank does not own the position of keep what their slot held.
    k_cache = k_cache.at[rows, slot].set(jnp.where(owned, k, k_cache[rows, slot]))
    v_cache = v_cache.at[rows, slot].set(jnp.where(owned, v, v_cache[rows, slot]))
    valid = first + jnp.arange(local)[None, :] <= position[:, None]
    return (k_cache, v_cache), merge(*partial_attention(q, k_cache, v_cache, valid))

  (k_cache, v_cache), (out, lse) = jax.lax.scan(step, (k_cache, v_cache), (q, k_new, v_new, jnp.arange(q.shape[0])))
  return out, lse, k_cache, v_cache


def build(mesh, merge: str):
  steps_spec = P(None, None, AXIS, None)  # [step, B, H, D]: each rank returns its head shard
  run = jax.shard_map(lambda *a: decode(*a, MERGES[merge]), mesh=mesh,
                      in_specs=(P(), P(), P(), CACHE_SPEC, CACHE_SPEC, P()),
                      out_specs=(steps_spec, P(None, None, AXIS), CACHE_SPEC, CACHE_SPEC))
  return jax.jit(run, donate_argnums=(3, 4))  # the cache is updated in place


def reference(q, k_new, v_new, k_cache, v_cache, lengths):
  """Every step's full attention in float64: out [steps, B, H, D], lse [steps, B, H].
  One cache holds every step's append: step t sees positions <= lengths + t,
  which the steps after it do not write."""
  q, k_new, v_new, k, v = (np.asarray(x, np.float64) for x in (q, k_new, v_new, k_cache, v_cache))
  steps, batch = q.shape[:2]
  positions = lengths[None, :] + np.arange(steps)[:, None]  # [step, B]
  k[np.arange(batch)[None, :], positions], v[np.arange(batch)[None, :], positions] = k_new, v_new
  # [B, H, step, S] by matmul (BLAS): the GPU sizes take seconds, not minutes.
  scores = q.transpose(1, 2, 0, 3) @ k.transpose(0, 2, 3, 1) / np.sqrt(q.shape[-1])
  visible = np.arange(k.shape[1])[None, None, :] <= positions.T[:, :, None]  # [B, step, S]
  scores = np.where(visible[:, None], scores, -np.inf)
  m = scores.max(-1, keepdims=True)
  lse = m[..., 0] + np.log(np.exp(scores - m).sum(-1))
  out = np.exp(scores - lse[..., None]) @ v.transpose(0, 2, 1, 3)  # [B, H, step, D]
  return out.transpose(2, 0, 1, 3), lse.transpose(2, 0, 1)


def run(mesh, merge: str, steps, k_cache, v_cache, lengths, progress: _runner.Progress):
  """The first execution's out and lse, and the median seconds per decode step."""
  with b12x_jax.channel("decode"):
    loop = build(mesh, merge)
    out, lse, k_cache, v_cache = jax.block_until_ready(loop(*steps, k_cache, v_cache, lengths))
    progress.step(f"{merge}: compiled and run")
    times = []
    for i in range(args.repeats):  # one execution at a time: XLA:CPU can hang on queued multi-device runs
      start = time.perf_counter()
      # The same appends rewrite the same positions: each execution computes the same steps.
      _, _, k_cache, v_cache = jax.block_until_ready(loop(*steps, k_cache, v_cache, lengths))
      times.append(time.perf_counter() - start)
      progress.step(f"{merge}: run {i + 1}/{args.repeats}")
  b12x_jax.check_errors()
  return out, lse, float(np.median(times)) / args.steps


def relative_error(got: jax.Array, want: np.ndarray) -> float:
  """max |got - want| / max |want| over the shards of `got` this process holds."""
  return max(np.abs(np.asarray(shard.data, np.float64) - want[shard.index]).max()
             for shard in got.addressable_shards) / np.abs(want).max()


def global_array(x: np.ndarray, sharding) -> jax.Array:
  """x (the same on every process) as an array of `sharding`."""
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def plot(path: str, platform: str, us_per_step: dict) -> None:
  """Bars of us per decode step for each merge."""
  styles = {"b12x": ("b12x_jax.dcp_a2a", "tab:blue"), "all_to_all": ("all_to_all + merge", "tab:orange"),
            "none": ("no merge", "tab:gray")}
  _runner.bar_chart(path, {m: (*styles[m], us) for m, us in us_per_step.items()}, "us per decode step",
                    f"DCP decode, {args.devices} x {platform}, B={args.batch} H={args.heads} D={args.head_dim}, "
                    f"{args.kv_len} positions")


def main() -> None:
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  devices = gpus if len(gpus) >= args.devices else jax.devices("cpu")
  n, b, h, d, s, steps = args.devices, args.batch, args.heads, args.head_dim, args.kv_len, args.steps
  for flag, value in (("--heads", h), ("--kv-len", s)):
    if value % n:
      sys.exit(f"{flag}={value} must be a multiple of --devices={n}")
  if not 1 <= steps < s or b < 1 or args.repeats < 1:
    sys.exit(f"--steps={steps} must be between 1 and --kv-len - 1, and --batch, --repeats at least 1")
  mesh = jax.make_mesh((n,), (AXIS,), devices=devices[:n])
  dtype = jnp.dtype(args.dtype)

  rng = np.random.default_rng(args.seed)
  q, k_new, v_new = (rng.standard_normal((steps, b, h, d)).astype(dtype) for _ in range(3))
  # Every position starts random: those a step has not written yet must stay masked.
  k_cache, v_cache = (rng.standard_normal((b, s, h, d)).astype(dtype) for _ in range(2))
  # Row 0 starts with one key (every rank but 0 holds none of it), row 1 crosses
  # from rank 0's shard to rank 1's during the steps, the last row ends at the
  # cache's end; the others start at a random length.
  lengths = rng.integers(1, s - steps + 1, size=b).astype(np.int32)
  lengths[0], lengths[-1] = 1, s - steps
  if b > 2:
    lengths[1] = min(max(1, s // n - steps // 2), s - steps)
  empty = int(sum((lengths <= r * (s // n)).sum() for r in range(n)))
  print(f"mesh: {n} x {devices[0].platform}{f' in {args.processes} processes' if args.processes > 1 else ''}; B={b} H={h} D={d} {args.dtype}, {s} cache positions per row "
        f"({s // n} per rank), {steps} decode steps in one jitted loop; {empty} of {b * n} (row, rank) shards "
        f"start empty")

  replicated, by_position = NamedSharding(mesh, P()), NamedSharding(mesh, CACHE_SPEC)
  steps_in = tuple(global_array(x, replicated) for x in (q, k_new, v_new))
  lengths_in = global_array(lengths, replicated)
  want_out, want_lse = reference(q, k_new, v_new, k_cache, v_cache, lengths)

  # jax.lax.all_to_all (NCCL) cannot run between processes that share one GPU.
  merges = [m for m in MERGES if not (args.shared_gpu and m == "all_to_all")
            and not (devices[0].platform != "gpu" and m == "b12x-triton")]  # Pallas Triton has no CPU path
  progress = _runner.Progress(len(merges) * (1 + args.repeats))
  seconds, labels, notes = {}, {merge: merge for merge in merges}, []
  for merge in merges:
    if merge == "b12x-triton":  # a Communicator of its own: the channels of the first are released
      b12x_jax.get_communicator().close()
      b12x_jax.set_communicator(b12x_jax.Communicator(kernels="triton"))
    cache = [global_array(x, by_position) for x in (k_cache, v_cache)]  # donated: a fresh copy per merge
    out, lse, seconds[merge] = run(mesh, merge, steps_in, *cache, lengths_in, progress)
    if merge.startswith("b12x"):
      decisions = [d for d in b12x_jax.get_communicator().decisions if d.op == "dcp_a2a"]
      labels[merge], note = _runner.path_label(merge, decisions[-1:])
      notes += [note] if note else []
      kernel = f", the {decisions[-1].kernel} kernel" if decisions[-1].kernel else ""
      print(f"dcp_a2a path{'' if merge == 'b12x' else f' of {merge}'}: {decisions[-1].path}{kernel} "
            f"({decisions[-1].reason})")
    if merge == "none":
      continue  # each rank's own partials: not the attention
    out_err, lse_err = relative_error(out, want_out), relative_error(lse, want_lse)
    if not (out_err < 2e-2 and lse_err < 1e-4):
      sys.exit(f"{merge}: relative error out {out_err:.1e}, lse {lse_err:.1e} vs float64 full attention "
               f"(bounds 2e-2 and 1e-4)")
    print(f"{labels[merge]:12s}: {seconds[merge] * 1e6:9.1f} us per decode step; relative error over {steps} "
          f"steps: out {out_err:.1e}, lse {lse_err:.1e}")
  print(f"{'no merge':12s}: {seconds['none'] * 1e6:9.1f} us per decode step (each rank's own partials: timing only)")
  for merge in merges[:-1]:
    share = 1 - seconds["none"] / seconds[merge]
    print(f"merge share of a step ({labels[merge]}): " + (f"{share:.0%}" if share >= 0 else
          "below the timing noise (a step with the merge ran faster than one without)"))
  if "all_to_all" in seconds:
    print(f"all_to_all / {labels['b12x']}: {seconds['all_to_all'] / seconds['b12x']:.2f}x per decode step")
  else:
    print("all_to_all not timed: NCCL cannot run between processes that share one GPU (--shared-gpu)")
  for note in notes:
    print(note)
  if devices[0].platform == "cpu":
    print(CPU_TIMINGS)
  if args.plot:
    plot(args.plot, devices[0].platform, {merge: t * 1e6 for merge, t in seconds.items()})
  print("dcp decode OK")


if __name__ == "__main__":
  main()
