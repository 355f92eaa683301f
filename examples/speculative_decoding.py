"""Greedy speculative decoding on the devices: a tensor-parallel Llama-style target and draft.

The model is a Llama-style decoder (RMSNorm, rotary embeddings, grouped-query
attention with a KV cache, SwiGLU MLP) with random weights from a fixed seed,
tensor-parallel over a mesh axis as production models are: q/k/v and the MLP's
gate/up columns are split across the ranks (column-parallel), the attention
output and MLP down projections are row-parallel, and the embedding and the
output head are split by vocabulary. Each row-parallel output goes through
b12x_jax.all_reduce_residual_rmsnorm (all-reduce, residual add and the next
RMSNorm in one collective); the embedding and the greedy argmax over the
vocabulary shards use b12x_jax.all_reduce.

The draft has its own layers (fewer, initialised from the target's first ones,
as a distilled draft would be) and shares the embedding and head. Draft
collectives are traced under b12x_jax.channel("draft"), target ones under
"target". The whole generation is one jitted lax.while_loop: each round the
draft proposes k tokens (lax.scan), the target scores the k+1 positions in one
forward pass, the longest prefix every row agrees on plus the target's own next
token is kept, and both KV caches roll back by their length alone (positions
are indices; stale entries are masked until rewritten). No host round trip per
token. The tokens must equal plain greedy decoding of the target on one device,
checked on every run (exactly in float32; in bf16/fp16 see check_tokens). The
same program with jax.lax.psum (and the norm in jnp) is timed next to it, and a
round alone with each, and with no collectives at all (each rank keeps its
partial sums: timing only), gives the collectives' share of a round. With
--host-loop the generation also runs as a serving loop does, one jitted round
per dispatch from Python (timed for b12x and psum, tokens checked the same way).

  python examples/speculative_decoding.py          # 2 CPU devices unless >= 2 GPUs
  python examples/speculative_decoding.py --processes 2 --shared-gpu   # 2 processes on GPU 0 (MPS on)
  python examples/speculative_decoding.py --host-loop   # also one round per dispatch from Python
  python examples/speculative_decoding.py --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 \\
      --layers 8 --vocab 32000 --dtype bfloat16 --new-tokens 128
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, NamedTuple

import _runner

# Printed next to timings taken on emulated CPU devices, and shown by --help.
CPU_TIMINGS = ("On CPU devices the timings measure the emulation (XLA:CPU devices and the host-memory backend "
               "sharing this machine's cores), not the library's speed on GPUs.")
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=CPU_TIMINGS,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--devices", type=int, default=2, help="tensor-parallel ranks")
parser.add_argument("--hidden", type=int, default=128, help="model width")
parser.add_argument("--layers", type=int, default=4, help="target layers")
parser.add_argument("--draft-layers", type=int, default=1, help="draft layers")
parser.add_argument("--heads", type=int, default=8, help="query heads (a multiple of --devices)")
parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads (divide --heads, a multiple of --devices)")
parser.add_argument("--ffn", type=int, default=384, help="MLP width (a multiple of --devices)")
parser.add_argument("--vocab", type=int, default=256, help="vocabulary size (a multiple of --devices)")
parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
parser.add_argument("--prompt", type=int, default=8, help="prompt length (at least 2)")
parser.add_argument("--new-tokens", type=int, default=32, help="tokens to generate per sequence")
parser.add_argument("-k", "--k", type=int, default=4, help="draft tokens per round")
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="dtype of weights and activations")
parser.add_argument("--repeats", type=int, default=3, help="timed generations per variant (the median is shown)")
parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt")
parser.add_argument("--plot", metavar="PATH", help="write a PNG of the timings (needs matplotlib)")
parser.add_argument("--host-loop", action="store_true",
                    help="also time the generation as a serving loop runs it: one jitted round per dispatch from "
                         "Python")
_runner.add_arguments(parser)
args = parser.parse_args()
_runner.emulate_cpu_devices(_runner.host_devices(args))
_runner.launch_or_join(args)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import b12x_jax  # noqa: E402

AXIS = "tp"
EPS = 1e-5
ROPE_BASE = 10000.0
F32 = jnp.float32
REPLAY_ROUNDS = 16  # rounds per timed execution of a round alone
# How each parameter is split over the tensor-parallel axis. Layer weights
# carry a leading layer axis (the layers run under lax.scan).
LAYER_SPECS = {"attn_norm": P(), "mlp_norm": P(),
               "wq": P(None, None, AXIS, None), "wk": P(None, None, AXIS, None), "wv": P(None, None, AXIS, None),
               "wo": P(None, AXIS, None, None),  # [layer, head, head_dim, hidden]: row-parallel
               "w_gate": P(None, None, AXIS), "w_up": P(None, None, AXIS), "w_down": P(None, AXIS, None)}
PARAM_SPECS = {"embed": P(AXIS, None), "head": P(None, AXIS), "final_norm": P(), "layers": LAYER_SPECS}


# -- the model: one rank's shard ---------------------------------------------------


class Collectives(NamedTuple):
  """How ranks combine partial results: `sum` is an all-reduce, `sum_add_norm`
  the all-reduce, residual add and RMSNorm after a row-parallel layer,
  returning (normed, new_residual)."""
  sum: Callable
  sum_add_norm: Callable


def rms_norm(x, weight):
  x32 = x.astype(F32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + EPS) * weight.astype(F32)).astype(x.dtype)


def add_rms_norm(total, residual, weight):
  """all_reduce_residual_rmsnorm's math after the sum: the new residual is
  rounded once, and normed from the rounded value."""
  new_residual = (total.astype(F32) + residual.astype(F32)).astype(total.dtype)
  return rms_norm(new_residual, weight), new_residual


COLLECTIVES = {
    "b12x": Collectives(lambda y: b12x_jax.all_reduce(y, AXIS),
                        lambda y, residual, w: b12x_jax.all_reduce_residual_rmsnorm(y, residual, w, AXIS, eps=EPS)),
    "psum": Collectives(lambda y: jax.lax.psum(y, AXIS),
                        lambda y, residual, w: add_rms_norm(jax.lax.psum(y, AXIS), residual, w)),
    # No communication: right on one device (the reference); on several, a
    # timing baseline where each rank keeps its partial sums (tokens unchecked).
    "none": Collectives(lambda y: y, add_rms_norm),
}


def rope(x, positions):
  """Rotary embedding of x [batch, T, heads, head_dim] at positions [T]."""
  half = x.shape[-1] // 2
  angles = positions[:, None].astype(F32) * ROPE_BASE ** (-jnp.arange(half, dtype=F32) / half)
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  x1, x2 = x[..., :half].astype(F32), x[..., half:].astype(F32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def attention(h, p, k_cache, v_cache, pos):
  """Grouped-query attention of this rank's heads for h [batch, T, hidden] at
  positions pos..pos+T-1, writing their keys and values into the cache
  [batch, position, kv_head, head_dim]. Returns this rank's partial output
  projection (row-parallel: summed over ranks by the caller) and the cache."""
  batch, t, _ = h.shape
  positions = pos + jnp.arange(t)
  q = rope(jnp.einsum("btd,dhk->bthk", h, p["wq"]), positions)
  k = rope(jnp.einsum("btd,dhk->bthk", h, p["wk"]), positions)
  v = jnp.einsum("btd,dhk->bthk", h, p["wv"])
  k_cache = jax.lax.dynamic_update_slice(k_cache, k, (0, pos, 0, 0))
  v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, pos, 0, 0))
  heads, kv_heads, head_dim = q.shape[2], k_cache.shape[2], q.shape[3]
  q = q.reshape(batch, t, kv_heads, heads // kv_heads, head_dim)  # query head j reads kv head j // group
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k_cache, preferred_element_type=F32) / np.sqrt(head_dim)
  # Causal over the cache: entries past the query (stale ones after a rollback too) stay masked.
  visible = jnp.arange(k_cache.shape[1])[None, :] <= positions[:, None]
  probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).astype(h.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache).reshape(batch, t, heads, head_dim)
  return jnp.einsum("bthk,hkd->btd", out, p["wo"]), k_cache, v_cache


def mlp(h, p):
  """SwiGLU over this rank's MLP columns; a partial sum (row-parallel down)."""
  return (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def embed(table, tokens, rank):
  """This rank's vocabulary rows of the embedding; 0 for tokens it lacks."""
  rows = table.shape[0]
  local = tokens - rank * rows
  held = (local >= 0) & (local < rows)
  return jnp.where(held[..., None], table[jnp.clip(local, 0, rows - 1)], 0)


def greedy_tokens(h, head, rank, comm: Collectives):
  """argmax over the vocabulary of h @ head, the head split by vocabulary
  columns: each rank puts its best logit and token id in its own slot of a
  zero array and one all-reduce hands every rank all of them (an all-gather).
  Ties go to the lowest id, as jnp.argmax does."""
  logits = jnp.einsum("btd,dv->btv", h, head, preferred_element_type=F32)
  best = jnp.stack([jnp.max(logits, -1), (jnp.argmax(logits, -1) + rank * head.shape[1]).astype(F32)], -1)
  slots = jnp.zeros((jax.lax.axis_size(AXIS),) + best.shape, F32).at[rank].set(best)
  slots = comm.sum(slots)  # [rank, batch, T, (logit, id)]; ids are exact in f32 below 2**24
  winner = jnp.argmax(slots[..., 0], axis=0)  # the first rank holding the max: the lowest id
  return jnp.take_along_axis(slots[..., 1], winner[None], 0)[0].astype(jnp.int32)


def forward(params, cache, tokens, pos, comm: Collectives):
  """The greedy next token after each of `tokens` [batch, T] at positions
  pos..pos+T-1, and the KV cache with those positions written."""
  h, cache = decoder(params, cache, tokens, pos, comm)
  return greedy_tokens(h, params["head"], jax.lax.axis_index(AXIS), comm), cache


def decoder(params, cache, tokens, pos, comm: Collectives):
  """The final normed hidden states [batch, T, hidden] of `tokens`, and the cache."""
  rank = jax.lax.axis_index(AXIS)
  layers = params["layers"]
  x = comm.sum(embed(params["embed"], tokens, rank))
  # Each layer's last norm is the next layer's input norm (the final norm after the last layer).
  next_norms = jnp.concatenate([layers["attn_norm"][1:], params["final_norm"][None]])

  def layer(carry, per_layer):
    h, residual = carry
    p, next_norm, k_cache, v_cache = per_layer
    out, k_cache, v_cache = attention(h, p, k_cache, v_cache, pos)
    h, residual = comm.sum_add_norm(out, residual, p["mlp_norm"])
    h, residual = comm.sum_add_norm(mlp(h, p), residual, next_norm)
    return (h, residual), (k_cache, v_cache)

  (h, _), (k, v) = jax.lax.scan(layer, (rms_norm(x, layers["attn_norm"][0]), x),
                                (layers, next_norms, cache["k"], cache["v"]))
  return h, {"k": k, "v": v}


def collectives_per_pass(layers: int) -> tuple[int, int]:
  """(fused all_reduce_residual_rmsnorm, plain all_reduce) calls of one forward pass."""
  return 2 * layers, 2  # two per layer; the embedding and the argmax


def new_cache(params, batch: int, positions: int):
  """An empty KV cache for this rank's kv heads, varying over the axis (each rank's own)."""
  layers, _, kv_heads, head_dim = params["layers"]["wk"].shape
  zeros = jnp.zeros((layers, batch, positions, kv_heads, head_dim), params["embed"].dtype)
  return {"k": jax.lax.pcast(zeros, AXIS, to="varying"), "v": jax.lax.pcast(zeros, AXIS, to="varying")}


def on_channel(name: str, fn):
  """fn, traced under b12x_jax.channel(name): its b12x collectives run there."""
  def traced(*a):
    with b12x_jax.channel(name):
      return fn(*a)
  return traced


# -- decoding -------------------------------------------------------------------------


def runners(target, draft, comm: Collectives):
  """(target forward, draft forward), each traced on its own b12x channel."""
  return (on_channel("target", lambda cache, toks, pos: forward(target, cache, toks, pos, comm)),
          on_channel("draft", lambda cache, toks, pos: forward(draft, cache, toks, pos, comm)))


def prefill(target, draft, prompt, comm: Collectives, k: int, new_tokens: int):
  """The decoding state after the prompt: (tokens [batch, P + new_tokens + k],
  n known tokens, target cache, draft cache, rounds, accepted draft tokens)."""
  batch, p = prompt.shape
  end = p + new_tokens
  run_target, run_draft = runners(target, draft, comm)
  tokens = jnp.zeros((batch, end + k), jnp.int32).at[:, :p].set(prompt)  # room for a last round's k+1
  # Both caches hold positions [0, n-1) of the n known tokens: the last is fed next.
  _, target_cache = run_target(new_cache(target, batch, end + k), prompt[:, :-1], 0)
  # The draft's prefill after the target's: calls of two channels that do not
  # depend on each other may run in different orders on different ranks
  # (XLA:CPU across processes does), and then wait for each other until the
  # timeout (README, "the rule for users"). The rounds below depend in turn.
  target_cache, draft_prompt = jax.lax.optimization_barrier((target_cache, prompt[:, :-1]))
  _, draft_cache = run_draft(new_cache(draft, batch, end + k), draft_prompt, 0)
  zero = jnp.int32(0)
  return tokens, jnp.int32(p), target_cache, draft_cache, zero, zero


def decode_round(target, draft, state, comm: Collectives, k: int):
  """One round: the draft proposes k tokens (lax.scan), the target scores the
  k+1 positions in one pass, and the longest prefix every row agrees on plus
  the target's own next token is kept. Returns the next state."""
  run_target, run_draft = runners(target, draft, comm)
  tokens, n, target_cache, draft_cache, rounds, accepted = state
  # Re-feed the token before the last too: after a round that accepted all
  # k proposals the draft's cache lacks that position.
  first, draft_cache = run_draft(draft_cache, jax.lax.dynamic_slice_in_dim(tokens, n - 2, 2, axis=1), n - 2)

  def step(carry, pos):
    cache, last = carry
    nxt, cache = run_draft(cache, last[:, None], pos)
    return (cache, nxt[:, 0]), nxt[:, 0]

  (draft_cache, _), rest = jax.lax.scan(step, (draft_cache, first[:, 1]), n + jnp.arange(k - 1))
  proposals = jnp.concatenate([first[:, 1:], rest.T], axis=1)  # [batch, k]
  fed = jnp.concatenate([jax.lax.dynamic_slice_in_dim(tokens, n - 1, 1, axis=1), proposals], axis=1)
  verdict, target_cache = run_target(target_cache, fed, n - 1)  # the target's token after each of the k+1
  agree = jnp.cumprod(proposals == verdict[:, :k], axis=1).sum(axis=1).min()  # every row accepts as many
  # The accepted proposals equal the target's tokens; those past n + agree are rewritten next round.
  tokens = jax.lax.dynamic_update_slice_in_dim(tokens, verdict, n, axis=1)
  return tokens, n + agree + 1, target_cache, draft_cache, rounds + 1, accepted + agree


def speculative_generate(target, draft, prompt, comm: Collectives, k: int, new_tokens: int,
                         replay_rounds: int | None = None):
  """Greedy speculative decoding of prompt [batch, P] in one lax.while_loop.
  Returns (tokens [batch, P + new_tokens], rounds, accepted draft tokens).

  With replay_rounds, runs that many rounds at the prompt's position instead
  (each redoes the first round): the timing of a round with the same work on
  every rank, which the "none" variant needs (its ranks disagree on tokens,
  so their generations would run different numbers of rounds)."""
  end = prompt.shape[1] + new_tokens
  state = prefill(target, draft, prompt, comm, k, new_tokens)
  round_ = lambda state: decode_round(target, draft, state, comm, k)  # noqa: E731
  if replay_rounds is None:
    state = jax.lax.while_loop(lambda state: state[1] < end, round_, state)
  else:
    def replay(_, state):  # the round again at the same position: n stays
      tokens, _, *rest = round_(state)
      return (tokens, state[1], *rest)

    state = jax.lax.fori_loop(0, replay_rounds, replay, state)
  tokens, _, _, _, rounds, accepted = state
  return tokens[:, :end], rounds, accepted


def greedy_generate(params, prompt, new_tokens: int):
  """The reference: plain greedy decoding, one token per forward pass."""
  batch, p = prompt.shape
  comm = COLLECTIVES["none"]
  nxt, cache = forward(params, new_cache(params, batch, p + new_tokens), prompt, 0, comm)
  tokens = jnp.zeros((batch, p + new_tokens), jnp.int32).at[:, :p].set(prompt).at[:, p].set(nxt[:, -1])

  def step(n, state):
    tokens, cache = state
    nxt, cache = forward(params, cache, jax.lax.dynamic_slice_in_dim(tokens, n - 1, 1, axis=1), n - 1, comm)
    return jax.lax.dynamic_update_slice_in_dim(tokens, nxt, n, axis=1), cache

  return jax.lax.fori_loop(p + 1, p + new_tokens, step, (tokens, cache))[0]


def teacher_forced_logits(params, tokens):
  """The target's logits [batch, T, vocab] after each of `tokens` in one pass
  (on one device: the head holds the whole vocabulary)."""
  h, _ = decoder(params, new_cache(params, *tokens.shape), tokens, 0, COLLECTIVES["none"])
  return jnp.einsum("btd,dv->btv", h, params["head"], preferred_element_type=F32)


# 16-bit rounding differs between the ranks' sums and one device's matmul, and
# can flip a greedy choice where the target's two best logits are this close
# (in standard deviations of the logits); a wrong model misses by far more.
TIE_STDS = 0.02


def check_tokens(kind: str, got: np.ndarray, want: np.ndarray, logits_of) -> str | None:
  """None when `got` equals plain greedy decoding `want`. Otherwise, in 16-bit
  dtypes, a note if every generated token is the target's greedy choice for
  its own prefix up to rounding (logits_of: teacher-forced logits); else exits."""
  if np.array_equal(got, want):
    return None
  row, col = np.argwhere(got != want)[0]
  where = (f"{kind}: speculative tokens differ from greedy decoding on one device at row {row}, position {col}: "
           f"{got[row, col:col + 8].tolist()} vs {want[row, col:col + 8].tolist()}")
  if args.dtype == "float32":
    sys.exit(where)
  logits = np.asarray(logits_of(got))[:, args.prompt - 1:-1]  # the logits that chose each generated token
  chosen = np.take_along_axis(logits, got[:, args.prompt:, None], -1)[..., 0]
  shortfall = ((logits.max(-1) - chosen) / logits.std(-1)).max()
  if shortfall > TIE_STDS:
    sys.exit(f"{where}; a token is {shortfall:.3f} logit std below the target's best for its prefix "
             f"(rounding stays below {TIE_STDS})")
  return (f"{kind}: equal up to row {row}, position {col}, a near-tie of the target's logits ({args.dtype} "
          f"rounding); from there every token is the target's greedy choice for its prefix (within "
          f"{shortfall:.4f} logit std)")


# -- setup, timing, report ----------------------------------------------------------


def init_params(key, dtype) -> dict:
  """Random target weights; the draft takes its first layers."""
  d, f, v, n = args.hidden, args.ffn, args.vocab, args.layers
  h, kvh, dh = args.heads, args.kv_heads, args.hidden // args.heads
  keys = iter(jax.random.split(key, 16))

  def normal(shape, fan_in, scale=1.0):
    return (jax.random.normal(next(keys), shape, F32) * (scale / np.sqrt(fan_in))).astype(dtype)

  # Small residual branches (GPT-2's init) keep later layers refining the
  # first ones, so a draft made of the first layers often agrees.
  branch = 0.2 / np.sqrt(2 * n)
  norm = lambda shape: (1 + 0.1 * jax.random.normal(next(keys), shape, F32)).astype(dtype)  # noqa: E731
  return {"embed": normal((v, d), 1), "head": normal((d, v), d), "final_norm": norm((d,)),
          "layers": {"attn_norm": norm((n, d)), "mlp_norm": norm((n, d)),
                     "wq": normal((n, d, h, dh), d), "wk": normal((n, d, kvh, dh), d),
                     "wv": normal((n, d, kvh, dh), d), "wo": normal((n, h, dh, d), d, branch),
                     "w_gate": normal((n, d, f), d), "w_up": normal((n, d, f), d),
                     "w_down": normal((n, f, d), f, branch)}}


def draft_of(params) -> dict:
  """The draft: its own first --draft-layers layers (copied from the target,
  as a distilled draft would start), the target's embedding and head."""
  return {**params, "layers": jax.tree.map(lambda w: w[: args.draft_layers], params["layers"])}


class Timing(NamedTuple):
  tokens: np.ndarray
  rounds: int
  accepted: int
  seconds: float  # the median of the timed executions


def time_variant(mesh, kind: str, target, draft, prompt, progress: _runner.Progress,
                 replay_rounds: int | None = None) -> Timing:
  """Compiles and times the generation (or replay_rounds rounds) with the collectives of `kind`."""
  collectives = COLLECTIVES[kind.split("-")[0]]  # "b12x-triton": b12x's, under another Communicator
  generate = lambda t, d, p: speculative_generate(t, d, p, collectives, args.k, args.new_tokens,  # noqa: E731
                                                  replay_rounds)
  # The "none" variant leaves per-rank values where the sums are invariant
  # over the axis, so only the real variants let shard_map check that.
  run = jax.jit(jax.shard_map(generate, mesh=mesh, in_specs=(PARAM_SPECS, PARAM_SPECS, P()),
                              out_specs=(P(), P(), P()), check_vma=kind != "none"))
  what = "generation" if replay_rounds is None else f"{replay_rounds} rounds"
  (tokens, rounds, accepted), seconds = timed(lambda: run(target, draft, prompt), f"{kind} {what}", progress)
  tokens, rounds, accepted = (np.asarray(x.addressable_data(0)) for x in (tokens, rounds, accepted))  # replicated
  return Timing(tokens, int(rounds), int(accepted), seconds)


def timed(run: Callable, label: str, progress: _runner.Progress):
  """(run()'s result, the median seconds of --repeats runs after the one that compiles)."""
  result = jax.block_until_ready(run())  # compiles
  progress.step(f"{label}: compiled")
  times = []
  for i in range(args.repeats):  # one execution at a time: XLA:CPU can hang on queued multi-device runs
    start = time.perf_counter()
    result = jax.block_until_ready(run())
    times.append(time.perf_counter() - start)
    progress.step(f"{label}: run {i + 1}/{args.repeats}")
  return result, float(np.median(times))


CACHE_SPECS = {"k": P(None, None, None, AXIS, None), "v": P(None, None, None, AXIS, None)}  # kv heads split
STATE_SPECS = (P(), P(), CACHE_SPECS, CACHE_SPECS, P(), P())  # prefill's state


def time_host_loop(mesh, kind: str, target, draft, prompt, progress: _runner.Progress) -> Timing:
  """The generation as a serving loop runs it: the prefill and then one
  jitted round per dispatch from Python. The loop's stop test reads the
  round before the one just dispatched, so the host stays a round ahead of
  the devices; a round dispatched after the last changes nothing."""
  collectives = COLLECTIVES[kind.split("-")[0]]
  end = args.prompt + args.new_tokens

  def round_unless_done(t, d, state):
    return jax.lax.cond(state[1] < end, lambda s: decode_round(t, d, s, collectives, args.k), lambda s: s, state)

  start = jax.jit(jax.shard_map(lambda t, d, p: prefill(t, d, p, collectives, args.k, args.new_tokens), mesh=mesh,
                                in_specs=(PARAM_SPECS, PARAM_SPECS, P()), out_specs=STATE_SPECS))
  next_round = jax.jit(jax.shard_map(round_unless_done, mesh=mesh, in_specs=(PARAM_SPECS, PARAM_SPECS, STATE_SPECS),
                                     out_specs=STATE_SPECS))

  def generate():
    state = start(target, draft, prompt)
    while True:
      after = next_round(target, draft, state)
      if int(state[1].addressable_data(0)) >= end:
        return after
      state = after

  state, seconds = timed(generate, f"{kind} host loop", progress)
  tokens = np.asarray(state[0].addressable_data(0))[:, :end]  # replicated
  rounds, accepted = (int(x.addressable_data(0)) for x in state[4:])
  return Timing(tokens, rounds, accepted, seconds)


def check_args(n: int) -> None:
  """Exits naming the argument when the sizes do not split over n ranks."""
  for name, value in (("--heads", args.heads), ("--kv-heads", args.kv_heads), ("--ffn", args.ffn),
                      ("--vocab", args.vocab)):
    if value % n:
      sys.exit(f"{name}={value} must be a multiple of --devices={n} (each rank holds an equal shard)")
  if args.heads % args.kv_heads or args.hidden % args.heads or (args.hidden // args.heads) % 2:
    sys.exit(f"--kv-heads={args.kv_heads} must divide --heads={args.heads}, and --hidden / --heads must be even")
  if not 1 <= args.draft_layers <= args.layers:
    sys.exit(f"--draft-layers={args.draft_layers} must be between 1 and --layers={args.layers}")
  if args.prompt < 2 or args.k < 1 or args.new_tokens < 1 or args.repeats < 1 or args.batch < 1:
    sys.exit("--prompt must be >= 2, and --k, --new-tokens, --repeats, --batch >= 1")
  if args.vocab >= 2 ** 24:
    sys.exit(f"--vocab={args.vocab} must be below 2**24 (token ids travel as float32)")


def plot(path: str, platform: str, ms_per_token: dict, shares: dict) -> None:
  """Bars of ms per token of each kind of collective, labelled with the collectives' share."""
  styles = {"b12x": ("b12x_jax", "tab:blue"), "b12x-triton": ("b12x_jax (Triton)", "tab:green"),
            "psum": ("jax.lax.psum", "tab:orange")}
  notes = {k: f"collectives {share:.0%} of a round" for k, share in shares.items()}
  _runner.bar_chart(path, {k: (*styles[k], ms) for k, ms in ms_per_token.items()}, "ms per token",
                    f"speculative decoding, {args.devices} x {platform}, hidden {args.hidden}, {args.layers} "
                    f"layers, {args.dtype}", notes)


def main() -> None:
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  devices = gpus if len(gpus) >= args.devices else jax.devices("cpu")
  check_args(args.devices)
  mesh = jax.make_mesh((args.devices,), (AXIS,), devices=devices[: args.devices])
  # This process's device of the mesh (with --processes, each process has one).
  local = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
  dtype = jnp.dtype(args.dtype)
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), PARAM_SPECS)
  # Each device draws its own shard of the weights (no host copy of the model).
  target = jax.jit(init_params, static_argnums=1, out_shardings=shardings)(jax.random.key(args.seed), dtype)
  draft = jax.jit(draft_of, out_shardings=shardings)(target)
  prompt = jax.jit(lambda key: jax.random.randint(key, (args.batch, args.prompt), 0, args.vocab, jnp.int32),
                   out_shardings=NamedSharding(mesh, P()))(jax.random.key(args.seed + 1))
  print(f"mesh: {args.devices} x {devices[0].platform}"
        f"{f' in {args.processes} processes' if args.processes > 1 else ''}; target {args.layers} layers, draft "
        f"{args.draft_layers}; hidden {args.hidden}, heads {args.heads} (kv {args.kv_heads}), ffn {args.ffn}, vocab "
        f"{args.vocab}, {args.dtype}; batch {args.batch}, prompt {args.prompt}, k={args.k}, {args.new_tokens} new "
        f"tokens")

  # b12x with each kernel kind on GPUs (Pallas Triton has no CPU path), then
  # psum: jax.lax collectives (NCCL) cannot run between processes that share one GPU.
  b12x_kinds = ("b12x", "b12x-triton") if devices[0].platform == "gpu" else ("b12x",)
  kinds = b12x_kinds if args.shared_gpu else (*b12x_kinds, "psum")
  comm = b12x_jax.get_communicator()
  loops = len(kinds) if args.host_loop else 0
  progress = _runner.Progress((2 * len(kinds) + 1 + loops) * (1 + args.repeats) + 1)
  # Each variant's generation (checked below) and a round's time, and a
  # round's time with no collective (the share of the collectives).
  gen, rounds, kernels, host_loop = {}, {}, {}, {}
  labels, notes = {kind: kind for kind in kinds}, []
  for kind in kinds:
    if kind == "b12x-triton":  # a Communicator of its own: the channels of the first are released
      comm.close()
      b12x_jax.set_communicator(b12x_jax.Communicator(kernels="triton"))
    gen[kind] = time_variant(mesh, kind, target, draft, prompt, progress)
    b12x_jax.check_errors()
    if kind.startswith("b12x"):  # the paths its calls took (B12X_JAX_POLICY=psum: psum)
      decisions = [d for d in b12x_jax.get_communicator().decisions if d.channel in ("target", "draft")]
      labels[kind], note = _runner.path_label(kind, decisions)
      notes += [note] if note else []
    if kind == "b12x":  # its channels' epochs: b12x calls completed
      prepared = comm.prepared_channels()
      epochs = {ch: comm.stats(ch, local)["epoch"] if ch in prepared else 0 for ch in ("target", "draft")}
      paths = sorted({f"{d.op} {d.path}" for d in decisions})
    rounds[kind] = time_variant(mesh, kind, target, draft, prompt, progress, REPLAY_ROUNDS)
    b12x_jax.check_errors()
    if args.host_loop:
      host_loop[kind] = time_host_loop(mesh, kind, target, draft, prompt, progress)
      b12x_jax.check_errors()
    if kind.startswith("b12x"):
      kernels[kind] = sorted({f"{d.op} {d.kernel}" for d in b12x_jax.get_communicator().decisions if d.kernel})
  rounds["none"] = time_variant(mesh, "none", target, draft, prompt, progress, REPLAY_ROUNDS)

  # The reference on this process's device alone: the same weights drawn whole
  # (random draws do not depend on the sharding), every shard the whole model.
  one_device = jax.make_mesh((1,), (AXIS,), devices=[local])
  one_device_target = jax.jit(init_params, static_argnums=1,
                              out_shardings=jax.tree.map(lambda spec: NamedSharding(one_device, spec), PARAM_SPECS))(
                                  jax.random.key(args.seed), dtype)
  reference = jax.jit(jax.shard_map(lambda p, t: greedy_generate(p, t, args.new_tokens), mesh=one_device,
                                    in_specs=(PARAM_SPECS, P()), out_specs=P(), check_vma=False))
  want = np.asarray(reference(one_device_target, prompt.addressable_data(0)))
  progress.step("reference")

  b12x = gen["b12x"]
  ms_per_round = {kind: t.seconds / REPLAY_ROUNDS * 1e3 for kind, t in rounds.items()}
  share = {kind: 1 - ms_per_round["none"] / ms_per_round[kind] for kind in kinds}
  fused, plain = collectives_per_pass(args.layers)
  draft_fused, draft_plain = collectives_per_pass(args.draft_layers)
  # One target pass and k draft passes per round, one of each for the prompt,
  # whose argmax nobody reads: JAX drops that call, as it would drop a psum.
  target_calls = (1 + b12x.rounds) * (fused + plain) - 1
  draft_calls = (1 + b12x.rounds * args.k) * (draft_fused + draft_plain) - 1
  generations = 1 + args.repeats

  def row(label: str, values, fmt: str) -> None:
    print(f"{label:36s}" + "".join(f"{v:{fmt}}" for v in values))

  row("", [labels[k] for k in kinds], ">13s")
  row("ms per token (latency)", [gen[k].seconds / args.new_tokens * 1e3 for k in kinds], "13.3f")
  row("tokens/s", [args.batch * args.new_tokens / gen[k].seconds for k in kinds], "13.1f")
  if host_loop:
    row("ms per token, round per dispatch", [host_loop[k].seconds / args.new_tokens * 1e3 for k in kinds], "13.3f")
  row("ms per round (k drafts + verify)", [ms_per_round[k] for k in kinds], "13.3f")
  print(f"{'':36s}(no collectives: {ms_per_round['none']:.3f})")
  row("collectives share of a round", [share[k] for k in kinds], "13.0%")
  print(f"  share = 1 - (the round with every collective replaced by a local op) / (the round); rounds timed "
        f"{REPLAY_ROUNDS} at a time")
  if args.shared_gpu:
    print("  psum not timed: NCCL cannot run between processes that share one GPU (--shared-gpu)")
  print(f"collectives per token: {(target_calls + draft_calls) / args.new_tokens:.1f} b12x calls, counted from the "
        f"model: per forward pass {fused} all_reduce_residual_rmsnorm + {plain} all_reduce in the target, "
        f"{draft_fused} + {draft_plain} in the draft; {b12x.rounds} rounds of {args.k} draft passes + 1 target pass")
  if any(epochs.values()):
    print(f"b12x channel epochs per generation: target {epochs['target'] / generations:.0f}, draft "
          f"{epochs['draft'] / generations:.0f} (the model's count: {target_calls} and {draft_calls})")
  else:
    print("b12x channel epochs: none (no call took the b12x path)")
  print(f"paths taken by the b12x calls (comm.decisions): {', '.join(paths)}")
  for kind, taken in kernels.items():
    print(f"kernels of {kind}: {', '.join(taken) or 'none (no call took the b12x path)'}")
  for note in notes:
    print(note)
  print(f"acceptance {b12x.accepted / (b12x.rounds * args.k):.0%} ({b12x.accepted}/{b12x.rounds * args.k} "
        f"draft tokens), {args.new_tokens / b12x.rounds:.2f} tokens per round")
  if devices[0].platform == "cpu":
    print(CPU_TIMINGS)
  if args.plot:
    plot(args.plot, devices[0].platform, {k: gen[k].seconds / args.new_tokens * 1e3 for k in kinds},
         {k: share[k] for k in kinds})

  logits_of = jax.jit(jax.shard_map(teacher_forced_logits, mesh=one_device, in_specs=(PARAM_SPECS, P()),
                                    out_specs=P(), check_vma=False))
  for kind, t in host_loop.items():
    if (t.rounds, t.accepted) != (gen[kind].rounds, gen[kind].accepted):
      sys.exit(f"{kind}: the host loop ran {t.rounds} rounds accepting {t.accepted} draft tokens, the device loop "
               f"{gen[kind].rounds} accepting {gen[kind].accepted}")
  runs = {**gen, **{f"{kind} (round per dispatch)": t for kind, t in host_loop.items()}}
  notes = {kind: check_tokens(kind, t.tokens, want, lambda got: logits_of(one_device_target, got))
           for kind, t in runs.items()}
  equal = [kind for kind, note in notes.items() if note is None]
  if equal:
    print(f"tokens equal plain greedy decoding of the target on one device ({', '.join(equal)}; {args.batch} x "
          f"{args.new_tokens} new tokens): {want[0, args.prompt:args.prompt + 12].tolist()} ...")
  for note in notes.values():
    if note is not None:
      print(note)
  print("speculative decoding OK")


if __name__ == "__main__":
  main()
