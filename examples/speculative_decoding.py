"""Greedy speculative decoding with a tensor-parallel target and draft model.

A small decoder-only transformer (random weights from a fixed seed) runs
tensor-parallel over a mesh axis: attention heads and MLP columns are split
across ranks, and each layer's attention output and MLP output are summed with
an all-reduce. The draft model is the target's first layer(s) with the same
embeddings and head (self-speculation), so it agrees with the target often.

Every target collective runs on channel "target" and every draft collective
on channel "draft": their executables interleave on the devices without
sharing signal counters or staging memory. Each round the draft proposes `k`
tokens one at a time, the target scores all of them in one forward pass, and
the longest agreeing prefix plus the target's own next token is kept, so the
output equals plain greedy decoding of the target. The example checks that
against the target decoded one token at a time on one device, then runs the
same decoding with jax.lax.psum in place of b12x_jax.all_reduce.

  python examples/speculative_decoding.py                 # CPU devices unless >= 2 GPUs
  python examples/speculative_decoding.py --hidden 4096 --heads 32 --dtype bfloat16 --new-tokens 256
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
parser.add_argument("--devices", type=int, default=2, help="tensor-parallel ranks")
parser.add_argument("--vocab", type=int, default=512, help="vocabulary size")
parser.add_argument("--hidden", type=int, default=256, help="model width")
parser.add_argument("--heads", type=int, default=8, help="attention heads (a multiple of --devices)")
parser.add_argument("--layers", type=int, default=4, help="target layers")
parser.add_argument("--draft-layers", type=int, default=1, help="draft layers (the target's first ones)")
parser.add_argument("--prompt", type=int, default=8, help="prompt length")
parser.add_argument("--new-tokens", type=int, default=48, help="tokens to generate")
parser.add_argument("-k", type=int, default=4, help="draft tokens per round")
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype of weights and activations")
parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt")
args = parser.parse_args()
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={max(args.devices, 2)}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import b12x_jax  # noqa: E402

AXIS = "tp"
# Sharding of every parameter over the tensor-parallel axis (heads, MLP columns).
PARAM_SPECS = {"embed": P(), "head": P(), "final_norm": P(),
               "attn_norm": P(), "mlp_norm": P(),
               "wqkv": P(None, None, None, AXIS, None), "wo": P(None, AXIS, None, None),
               "w_up": P(None, None, AXIS), "w_down": P(None, AXIS, None)}
CACHE_SPEC = P(None, None, None, AXIS, None)  # [layer, k|v, position, head, head_dim]


def init_params(rng: np.random.Generator, dtype) -> dict:
  d, h, v, f = args.hidden, args.heads, args.vocab, 4 * args.hidden
  dh, n = d // h, args.layers

  def normal(shape, fan_in, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * (scale / np.sqrt(fan_in)), dtype)

  # Small residual branches (as in GPT-2's init) keep later layers refining
  # rather than replacing the first ones, so the draft's guesses often hold.
  branch = 0.2 / np.sqrt(2 * n)

  return {"embed": normal((v, d), 1), "head": normal((d, v), d), "final_norm": jnp.ones((d,), dtype),
          "attn_norm": jnp.ones((n, d), dtype), "mlp_norm": jnp.ones((n, d), dtype),
          "wqkv": normal((n, d, 3, h, dh), d), "wo": normal((n, h, dh, d), d, branch),
          "w_up": normal((n, d, f), d), "w_down": normal((n, f, d), f, branch)}


def rms_norm(x, w):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype) * w


def forward(params, cache, tokens, pos, layers: int, reduce):
  """Logits [T, vocab] of `tokens` [T] at positions pos..pos+T-1, with the
  KV cache updated there. Works on one rank's head and MLP shard; `reduce`
  sums a partial result over the ranks (identity on one device)."""
  x = params["embed"][tokens]
  t = tokens.shape[0]
  positions = pos + jnp.arange(t)
  visible = jnp.arange(cache.shape[2])[None, :] <= positions[:, None]  # causal over the cache
  for i in range(layers):
    qkv = jnp.einsum("td,dchk->tchk", rms_norm(x, params["attn_norm"][i]), params["wqkv"][i])
    new_kv = jnp.moveaxis(qkv[:, 1:], 1, 0)[None].astype(cache.dtype)  # [1, 2, T, heads, head_dim]
    cache = jax.lax.dynamic_update_slice(cache, new_kv, (i, 0, pos, 0, 0))
    keys, values = cache[i, 0], cache[i, 1]
    scores = jnp.einsum("thk,shk->hts", qkv[:, 0], keys).astype(jnp.float32) / np.sqrt(qkv.shape[-1])
    probs = jax.nn.softmax(jnp.where(visible[None], scores, -jnp.inf), axis=-1).astype(x.dtype)
    attn = jnp.einsum("hts,shk->thk", probs, values)
    x = x + reduce(jnp.einsum("thk,hkd->td", attn, params["wo"][i]))
    up = jax.nn.gelu(rms_norm(x, params["mlp_norm"][i]) @ params["w_up"][i])
    x = x + reduce(up @ params["w_down"][i])
  return (rms_norm(x, params["final_norm"]) @ params["head"]).astype(jnp.float32), cache


def new_cache(layers: int, dtype, heads: int):
  t_max = args.prompt + args.new_tokens + args.k + 2
  return jnp.zeros((layers, 2, t_max, heads, args.hidden // args.heads), dtype)


class TensorParallelModel:
  """One model's jitted steps on the mesh, traced under its channel."""

  def __init__(self, mesh, params, layers: int, channel: str, reduce):
    self.channel, self.layers = channel, layers
    specs = {name: PARAM_SPECS[name] for name in params}
    self.params = {name: jax.device_put(p, NamedSharding(mesh, specs[name])) for name, p in params.items()}

    def step(params, cache, tokens, pos):
      return forward(params, cache, tokens, pos, layers, lambda y: reduce(y, AXIS))

    self._step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, CACHE_SPEC, P(), P()),
                                       out_specs=(P(), CACHE_SPEC)), donate_argnums=1)
    self.cache = jax.device_put(new_cache(layers, params["embed"].dtype, args.heads), NamedSharding(mesh, CACHE_SPEC))

  def __call__(self, tokens, pos: int) -> np.ndarray:
    with b12x_jax.channel(self.channel):
      logits, self.cache = self._step(self.params, self.cache, jnp.asarray(tokens, jnp.int32), jnp.int32(pos))
    return np.asarray(logits)


def speculative_decode(target, draft, prompt: list[int], new_tokens: int,
                       progress: bool) -> tuple[list[int], int, int]:
  """Greedy speculative decoding; returns (tokens, drafted, accepted)."""
  tokens = list(prompt)
  target(tokens[:-1], 0)  # both caches hold positions [0, n-1): the last token is fed next
  draft(tokens[:-1], 0)
  drafted = accepted = 0
  end = len(prompt) + new_tokens
  while len(tokens) < end:
    n = len(tokens)
    # The draft re-feeds the token before the last as well: after a round
    # where every draft token was accepted its cache lacks that position.
    proposal = [int(np.argmax(draft(tokens[-2:], n - 2)[-1]))]
    for j in range(args.k - 1):
      proposal.append(int(np.argmax(draft(proposal[-1:], n + j)[-1])))
    verdict = np.argmax(target([tokens[-1]] + proposal, n - 1), axis=-1)
    agree = 0
    while agree < args.k and proposal[agree] == verdict[agree]:
      agree += 1
    tokens += proposal[:agree] + [int(verdict[agree])]
    drafted, accepted = drafted + args.k, accepted + agree
    if progress:
      done = min(len(tokens), end) - len(prompt)
      bar = "#" * (30 * done // new_tokens)
      print(f"\r  [{bar:30s}] {done}/{new_tokens} tokens", end="", file=sys.stderr, flush=True)
  if progress:
    print(file=sys.stderr)
  return tokens[:end], drafted, accepted


def greedy_on_one_device(params, prompt: list[int]) -> list[int]:
  """The reference: the full target on one device, one token at a time."""
  device = jax.devices()[0]
  params = jax.device_put(params, device)
  step = jax.jit(lambda p, c, t, pos: forward(p, c, t, pos, args.layers, lambda y: y), donate_argnums=1)
  cache = jax.device_put(new_cache(args.layers, params["embed"].dtype, args.heads), device)
  logits, cache = step(params, cache, jnp.asarray(prompt, jnp.int32), jnp.int32(0))
  tokens = list(prompt) + [int(np.argmax(logits[-1]))]
  while len(tokens) < len(prompt) + args.new_tokens:
    logits, cache = step(params, cache, jnp.asarray(tokens[-1:], jnp.int32), jnp.int32(len(tokens) - 1))
    tokens.append(int(np.argmax(logits[-1])))
  return tokens


def run(mesh, params, prompt, reduce, label: str) -> list[int]:
  draft_params = {name: p[: args.draft_layers] if name in ("attn_norm", "mlp_norm", "wqkv", "wo", "w_up", "w_down")
                  else p for name, p in params.items()}
  target = TensorParallelModel(mesh, params, args.layers, "target", reduce)
  draft = TensorParallelModel(mesh, draft_params, args.draft_layers, "draft", reduce)
  # Compiles every step shape. Stale cache entries need no reset: a position
  # is rewritten before the causal mask lets any query see it.
  speculative_decode(target, draft, prompt, new_tokens=args.k + 1, progress=False)
  start = time.perf_counter()
  tokens, drafted, accepted = speculative_decode(target, draft, prompt, args.new_tokens,
                                                 progress=sys.stderr.isatty())
  seconds = time.perf_counter() - start
  print(f"{label:28s}: {args.new_tokens / seconds:8.1f} tokens/s, acceptance {accepted / drafted:.0%} "
        f"({accepted}/{drafted} draft tokens)")
  return tokens


def main() -> None:
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  devices = gpus if len(gpus) >= args.devices else jax.devices("cpu")
  if args.heads % args.devices or (4 * args.hidden) % args.devices or args.hidden % args.heads:
    sys.exit("--heads and 4 * --hidden must divide by --devices, and --hidden by --heads")
  mesh = jax.make_mesh((args.devices,), (AXIS,), devices=devices[: args.devices])
  dtype = jnp.dtype(args.dtype)
  params = init_params(np.random.default_rng(args.seed), dtype)
  prompt = [int(t) for t in np.random.default_rng(args.seed + 1).integers(0, args.vocab, args.prompt)]
  print(f"mesh: {args.devices} x {devices[0].platform}; target {args.layers} layers, draft {args.draft_layers}, "
        f"hidden {args.hidden}, {args.dtype}, k={args.k}, {args.new_tokens} new tokens")

  got = run(mesh, params, prompt, b12x_jax.all_reduce, "b12x_jax.all_reduce")
  b12x_jax.check_errors()
  comm = b12x_jax.get_communicator()
  print("collectives per channel on rank 0: " + ", ".join(
      f"{name} {comm.stats(name, mesh.devices.flat[0])['epoch']}" for name in ("target", "draft")))
  baseline = run(mesh, params, prompt, jax.lax.psum, "jax.lax.psum")
  if devices[0].platform == "cpu":
    print(CPU_TIMINGS)

  want = greedy_on_one_device(params, prompt)
  for label, tokens in (("b12x_jax", got), ("psum", baseline)):
    if tokens != want:
      first = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
      sys.exit(f"{label}: speculative tokens differ from greedy decoding on one device at position {first}: "
               f"{tokens[first:first + 8]} vs {want[first:first + 8]}")
  print(f"tokens equal plain greedy decoding of the target on one device ({args.new_tokens} new tokens): "
        f"{want[len(prompt):len(prompt) + 12]} ...")
  print("speculative decoding OK")


if __name__ == "__main__":
  main()
