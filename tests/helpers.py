"""Shared test helpers: float64 references and sharded inputs."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

DTYPES = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16, "float16": np.float16}
# Tolerance of one final rounding of an fp32 sum, relative to the magnitudes summed.
RTOL = {"float32": 1e-6, "bfloat16": 8e-3, "float16": 1e-3}


def fresh_communicator(**options):
  """A new Communicator with ``options`` for the block (see installed).
  Options the constructor rejects raise before anything is closed."""
  import b12x_jax
  return installed(b12x_jax.Communicator(**options))


@contextlib.contextmanager
def installed(comm):
  """``comm`` as the communicator for the block (the current one is closed
  first: one communicator holds channels at a time), then a default."""
  import b12x_jax
  b12x_jax.get_communicator().close()
  b12x_jax.set_communicator(comm)
  try:
    yield comm
  finally:
    comm.close()
    b12x_jax.set_communicator(b12x_jax.Communicator())


@contextlib.contextmanager
def mount_namespace(setup: str, what: str):
  """A mount namespace that the shell command ``setup`` has changed, held
  by a sleeping process: yields the command prefix that runs a process in
  it. Needs root and unshare/nsenter; skips the test, with the reason and
  ``what`` it wanted, without them."""
  if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")):
    pytest.skip(f"{what} needs root, unshare and nsenter to mount it in a mount namespace")
  holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             f"{setup} && echo ready && exec sleep 600"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    if holder.stdout.readline().strip() != "ready":
      holder.kill()
      pytest.skip(f"no mount namespace with {what} here: {holder.communicate()[1].strip()}")
    enter = ("nsenter", f"--mount=/proc/{holder.pid}/ns/mnt", "--")
    joined = subprocess.run([*enter, "true"], capture_output=True, text=True)
    if joined.returncode != 0:
      pytest.skip(f"no process may enter that mount namespace here: {joined.stderr.strip()}")
    yield enter
  finally:
    holder.kill()
    holder.wait()


def random_shards(rng: np.random.Generator, n: int, elems: int, dtype) -> np.ndarray:
  """n fresh random shards of ``elems`` elements each (never zeros)."""
  return rng.standard_normal((n, elems)).astype(np.float32).astype(dtype)


def put_sharded(mesh, host: np.ndarray, axis: str = "x"):
  """Rows of ``host`` onto the devices of ``mesh`` along ``axis``."""
  return jax.device_put(host.reshape((-1,) + host.shape[2:]) if host.ndim > 2 else host.reshape(-1),
                        NamedSharding(mesh, P(axis)))


def assert_sum_matches(got_per_rank: np.ndarray, shards: np.ndarray, dtype_name: str, roundings: int = 1) -> None:
  """Every rank's result equals the float64 sum of the shards within
  ``roundings`` roundings (1 for b12x: fp32 accumulation; psum may round at
  every step), and all ranks hold identical bits."""
  want = shards.astype(np.float64).sum(axis=0)
  scale = np.abs(shards.astype(np.float64)).sum(axis=0) + 1e-30
  for r, got in enumerate(got_per_rank):
    err = np.abs(got.astype(np.float64) - want) / scale
    assert np.all(np.isfinite(got.astype(np.float64))), f"rank {r}: non-finite output"
    assert err.max() <= RTOL[dtype_name] * roundings, f"rank {r}: max relative error {err.max()} > {RTOL[dtype_name]}"
  first = np.ascontiguousarray(got_per_rank[0]).view(np.uint8)
  for r, got in enumerate(got_per_rank[1:], start=1):
    assert np.array_equal(first, np.ascontiguousarray(got).view(np.uint8)), f"rank {r} differs from rank 0 in bits"


# -- all_reduce: every protocol ----------------------------------------------------------------------

# Payloads around a Lamport window of ALGORITHM_LAMPORT_BYTES: inside it (the Lamport exchange), and
# above it (the barrier algorithm asked for), with shards of two-shot that do not divide evenly.
ALGORITHM_LAMPORT_BYTES = 4096
ALGORITHM_SIZES = (16, 1024, 4096, 4096 + 16, 3 * 16 * 1024 + 48)


def check_every_protocol(mesh, algorithm: str, seed: int, **options) -> int:
  """all_reduce on ``mesh`` (axis "x") with ``algorithm`` above the Lamport
  window, for every size of ALGORITHM_SIZES and dtype, twice each on fresh
  inputs, against float64, with poisoned outputs, on a fresh Communicator
  with ``options`` besides (closed after). Returns the calls checked."""
  import b12x_jax
  from jax.sharding import PartitionSpec as P

  n = mesh.devices.size
  rng = np.random.default_rng(seed)
  fn = jax.jit(jax.shard_map(lambda x: b12x_jax.all_reduce(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  checked = 0
  with fresh_communicator(poison_outputs=True, algorithm=algorithm, lamport_bytes=ALGORITHM_LAMPORT_BYTES,
                          **options) as comm:
    with b12x_jax.channel("protocols"):
      for nbytes in ALGORITHM_SIZES:
        for dtype_name, dtype in DTYPES.items():
          for _ in range(2):  # both slots, or two Lamport buffers
            shards = random_shards(rng, n, nbytes // np.dtype(dtype).itemsize, dtype)
            got = np.asarray(fn(put_sharded(mesh, shards))).reshape(shards.shape)
            assert comm.decisions[-1].path == "b12x", comm.decisions[-1]
            assert_sum_matches(got, shards, dtype_name)
            checked += 1
  return checked


def mismatch_program(op: str, n: int, rng: np.random.Generator):
  """The program of the mismatch modes (tests/workers.py, tests/mp_workers.py)
  over axis "x" of ``n`` ranks, and one rank's inputs: the last rank runs
  another call than the others on the channel, one program for all (a
  lax.cond on the rank). With ``op`` dcp_a2a a merge of out [2, 8n, 256]
  against the others' [1, 16n, 256] (bfloat16: one size and one plan, told
  apart by the call tag alone), with residual_rmsnorm the fused op on a
  row of 4096 float32 against the others' 8192 (the Triton kernel splits
  both rows over 4 programs, which meet even where they fail), else an all_reduce of 128
  float32 against the others' 64 (the shorter call padded with NaN: a
  finite element can only be a wrong number). Returns (the shard_map body,
  the inputs)."""
  import jax.numpy as jnp

  import b12x_jax
  odd_one = lambda: jax.lax.axis_index("x") == n - 1  # noqa: E731
  if op == "dcp_a2a":
    def merge(out, lse):  # [1, 16, 256] or [2, 8, 256] per rank: as [16, 256] either way
      return b12x_jax.dcp_a2a(out, lse, "x").reshape(16, 256).astype(jnp.float32)

    def body(out, lse):
      return jax.lax.cond(odd_one(), lambda: merge(out[:, :8 * n], lse[:, :8 * n]), lambda: merge(out[:1], lse[:1]))
    return body, [rng.standard_normal((2, 16 * n, 256)).astype(jnp.bfloat16),
                  rng.standard_normal((2, 16 * n)).astype(np.float32)]

  if op == "residual_rmsnorm":
    def fused(x, residual, weight, hidden):
      normed, _ = b12x_jax.all_reduce_residual_rmsnorm(x[:, :hidden], residual[:, :hidden], weight[:hidden], "x")
      return jnp.concatenate([normed, jnp.full((1, 8192 - hidden), jnp.nan, normed.dtype)], axis=1)

    def fused_body(x, residual, weight):
      return jax.lax.cond(odd_one(), lambda: fused(x, residual, weight, 4096), lambda: fused(x, residual, weight, 8192))
    return fused_body, [rng.standard_normal((1, 8192)).astype(np.float32) for _ in range(2)] + [
        rng.standard_normal(8192).astype(np.float32)]

  if op in MISMATCHES_AT_ONE_SITE:
    return _one_site_mismatch(op, n, odd_one, rng)

  if op == "all_reduce_site":  # one call at two places of the program, nothing else differs
    def sites(x):
      return jax.lax.cond(odd_one(), lambda: b12x_jax.all_reduce(x, "x"),
                          lambda: b12x_jax.all_reduce(x, "x"))
    return sites, [rng.standard_normal(64).astype(np.float32)]

  def small(v):
    return jnp.concatenate([b12x_jax.all_reduce(v[:64], "x"), jnp.full(64, jnp.nan, v.dtype)])

  def body(x):
    return jax.lax.cond(odd_one(), lambda v: b12x_jax.all_reduce(v, "x"), small, x)
  return body, [rng.standard_normal(128).astype(np.float32)]


# mismatch_program's calls that differ in one thing the call tag holds, made at one site of the
# program (the same line, the same frames), so that nothing else tells them apart.
MISMATCHES_AT_ONE_SITE = ("all_reduce_dtype", "residual_rmsnorm_dtype", "dcp_a2a_lse_base")


def _one_site_mismatch(op: str, n: int, odd_one, rng: np.random.Generator):
  """mismatch_program for MISMATCHES_AT_ONE_SITE: the odd one out calls
  with float32 (lse in base 2) where the others call with bfloat16 of the
  same bytes (base e); outputs float32, the shorter padded with NaN."""
  import functools

  import jax.numpy as jnp

  import b12x_jax

  def pad(v, n):
    v = v.astype(jnp.float32)
    return jnp.concatenate([v, jnp.full((*v.shape[:-1], n - v.shape[-1]), jnp.nan, v.dtype)], axis=-1)

  if op == "all_reduce_dtype":  # float32[16] against bfloat16[32]: 64 bytes, one grid
    def reduce_as(dtype, x):
      v = x[:16] if dtype == jnp.float32 else x.astype(jnp.bfloat16)
      return pad(b12x_jax.all_reduce(v, "x"), 32)
    inputs = [rng.standard_normal(32).astype(np.float32)]
  elif op == "residual_rmsnorm_dtype":  # rows of 1024 float32 against 2048 bfloat16: 4096 bytes each
    def reduce_as(dtype, x, residual, weight):
      hidden = 1024 if dtype == jnp.float32 else 2048
      normed, _ = b12x_jax.all_reduce_residual_rmsnorm(*(a[..., :hidden].astype(dtype) for a in (x, residual, weight)),
                                                      "x")
      return pad(normed, 2048)
    inputs = [rng.standard_normal((1, 2048)).astype(np.float32) for _ in range(2)] + [
        rng.standard_normal(2048).astype(np.float32)]
  else:  # dcp_a2a of one shape, lse in base 2 against base e
    def reduce_as(dtype, out, lse):
      return b12x_jax.dcp_a2a(out, lse, "x", lse_base="2" if dtype == jnp.float32 else "e").astype(jnp.float32)
    inputs = [rng.standard_normal((1, 16 * n, 256)).astype(jnp.bfloat16),
              rng.standard_normal((1, 16 * n)).astype(np.float32)]

  def body(*args):
    return jax.lax.cond(odd_one(), functools.partial(reduce_as, jnp.float32), functools.partial(reduce_as, jnp.bfloat16),
                        *args)
  return body, inputs


def run_to_its_error(run, channel: str) -> dict:
  """Runs ``run()`` (a call that must fail, returning its output) on
  ``channel``, then check_errors. Returns the messages (the call's, as CPU
  raises from the call, then check_errors' lines), whether an output
  element was finite (None where the call raised) and the seconds."""
  import time

  import b12x_jax
  messages, finite = [], None
  start = time.monotonic()
  with b12x_jax.channel(channel):
    try:
      finite = bool(np.isfinite(np.asarray(run())).any())
    except Exception as e:  # noqa: BLE001 - CPU raises from the call
      messages.append(str(e))
  try:
    b12x_jax.check_errors()
  except b12x_jax.CollectiveTimeoutError as e:
    messages.extend(str(e).splitlines())
  return {"messages": messages, "finite": finite, "seconds": time.monotonic() - start}


# A call's site in the call-tag error, and its name where this process traced it.
SITE = r" at site 0x[0-9a-f]{8}(?: \([^()]*\))?"


def tag_error(rank: int, expected: str, peer: str | int, seen: str, channel: str = "mismatch") -> str:
  """The regex of the call-tag error (docs/DESIGN.md) ``channel`` reports
  at epoch 1: ``rank`` expected the call ``expected`` (a regex, its site
  left out) but ``peer`` (a rank, or a regex of one) was at ``seen``."""
  return (f"channel '{channel}' rank {rank} expected {expected}{SITE} at epoch 1 but rank {peer} was at {seen}{SITE}: "
          "the ranks run different calls on one channel")


def assert_names_both_calls(messages: list[str], calls: dict[int, str]) -> None:
  """The call-tag error of both ranks of tests/workers.py's mismatch mode:
  rank r at the call ``calls[r]`` (a regex), each naming both calls."""
  import re
  for rank, peer in ((0, 1), (1, 0)):
    pattern = tag_error(rank, calls[rank], peer, calls[peer])
    assert any(re.search(pattern, m) for m in messages), (pattern, messages)


# -- DCP: partial attention over KV shards, and the full attention it must merge to ---------------------


def attention_shards(rng: np.random.Generator, n: int, batch: int, heads: int, dim: int, dtype, *, kv: int = 8,
                     base2: bool = False, empty: tuple = (), all_empty: tuple = ()):
  """Fresh random attention split over ``n`` KV shards, each holding up to
  ``kv`` keys per (batch, head). Returns ``(outs, lses, want_out,
  want_lse)``: per-shard partial outputs [n, B, H, D] in ``dtype`` and lse
  [n, B, H] float32 (NaN output, -inf lse where a shard has no key), and,
  in float64, attention over the concatenated KV [B, H, D] and its lse
  [B, H] (0 and -inf where no shard has a key). ``empty`` lists (shard,
  b, h) with no key, ``all_empty`` (b, h) with no key on any shard; lse is
  in base 2 when ``base2``."""
  q = rng.standard_normal((batch, heads, dim))
  k = rng.standard_normal((n, batch, heads, kv, dim))
  v = rng.standard_normal((n, batch, heads, kv, dim))
  valid = np.arange(kv) < rng.integers(1, kv + 1, size=(n, batch, heads, 1))
  for s, b, h in empty:
    valid[s, b, h] = False
  for b, h in all_empty:
    valid[:, b, h] = False
  scores = np.where(valid, np.einsum("bhd,sbhkd->sbhk", q, k) / np.sqrt(dim), -np.inf)
  with np.errstate(invalid="ignore", divide="ignore"):
    lse = _logsumexp(scores, axes=(-1,))
    outs = np.einsum("sbhk,sbhkd->sbhd", np.exp(scores - lse[..., None]), v)
    full_lse = _logsumexp(np.moveaxis(scores, 0, -1), axes=(-2, -1))
    full = np.einsum("sbhk,sbhkd->bhd", np.exp(scores - full_lse[None, ..., None]), v)
  outs[~np.isfinite(lse)] = np.nan  # an empty shard's payload is garbage: it must never be read
  full[~np.isfinite(full_lse)] = 0.0
  scale = 1 / np.log(2) if base2 else 1.0
  return outs.astype(dtype), (lse * scale).astype(np.float32), full, full_lse * scale


def _logsumexp(x: np.ndarray, axes: tuple) -> np.ndarray:
  m = np.max(x, axis=axes, keepdims=True)
  safe = np.where(np.isfinite(m), m, 0.0)
  return np.squeeze(safe, axis=axes) + np.log(np.sum(np.exp(x - safe), axis=axes))


def assert_merge_matches(got_out: np.ndarray, got_lse: np.ndarray | None, outs: np.ndarray, want_out: np.ndarray,
                         want_lse: np.ndarray, dtype_name: str) -> None:
  """Every rank's head shard ([n, B, H/n, D] and [n, B, H/n]) matches the
  full attention: out within two roundings of the largest partial output of
  its row (the inputs' and the result's), lse within fp32 math; no NaN."""
  n = got_out.shape[0]
  shard = want_out.shape[1] // n
  row_scale = np.nan_to_num(np.abs(outs.astype(np.float64)), nan=0.0).max(axis=(0, -1))  # [B, H]
  for r in range(n):
    heads = slice(r * shard, (r + 1) * shard)
    got = got_out[r].astype(np.float64)
    assert np.all(np.isfinite(got)), f"rank {r}: non-finite output"
    err = np.abs(got - want_out[:, heads]).max(axis=-1)
    bound = 2 * RTOL[dtype_name] * row_scale[:, heads] + 1e-6
    assert np.all(err <= bound), f"rank {r}: error {err.max()} exceeds {bound[err > bound].min()}"
    if got_lse is not None:
      want = want_lse[:, heads]
      assert np.array_equal(np.isneginf(got_lse[r]), np.isneginf(want)), f"rank {r}: -inf lse differs"
      finite = np.isfinite(want)
      np.testing.assert_allclose(got_lse[r][finite], want[finite], rtol=1e-5, atol=1e-5, err_msg=f"rank {r}")


# -- all_reduce_residual_rmsnorm -------------------------------------------------------------------------


def residual_rmsnorm_fn(mesh, eps: float = 1e-6):
  """x sharded over "x" ([n, rows, hidden] -> one row block per rank), residual and weight
  replicated; every rank's results come back stacked [n, ...] so the test sees all of them."""
  import b12x_jax

  def body(x, residual, weight):
    normed, new_residual = b12x_jax.all_reduce_residual_rmsnorm(x[0], residual, weight, "x", eps=eps)
    return normed[None], new_residual[None]
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=(P("x"), P("x")),
                               check_vma=False))


def residual_rmsnorm_inputs(rng: np.random.Generator, n: int, rows: int, hidden: int, dtype_name: str):
  """Fresh random ``(shards [n, rows, hidden], residual [rows, hidden],
  weight [hidden])`` in the dtype, the weight near 1."""
  dtype = DTYPES[dtype_name]
  shards = rng.standard_normal((n, rows, hidden)).astype(np.float32).astype(dtype)
  residual = rng.standard_normal((rows, hidden)).astype(np.float32).astype(dtype)
  weight = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32).astype(dtype)
  return shards, residual, weight


def assert_residual_rmsnorm_matches(normed: np.ndarray, new_residual: np.ndarray, shards: np.ndarray,
                                    residual: np.ndarray, weight: np.ndarray, eps: float, dtype_name: str) -> None:
  """Every rank's results ([n, rows, hidden] each) against float64: the new
  residual within one rounding of sum(shards) + residual, the normed output
  within two roundings of the RMSNorm of the returned residual (the value
  the op normalises); no NaN; all ranks hold identical bits."""
  want = shards.astype(np.float64).sum(axis=0) + residual.astype(np.float64)
  scale = np.abs(shards.astype(np.float64)).sum(axis=0) + np.abs(residual.astype(np.float64)) + 1e-30
  w = weight.astype(np.float64)
  for r in range(normed.shape[0]):
    got_res = new_residual[r].astype(np.float64)
    got = normed[r].astype(np.float64)
    assert np.all(np.isfinite(got_res)) and np.all(np.isfinite(got)), f"rank {r}: non-finite output"
    err = np.abs(got_res - want) / scale
    assert err.max() <= RTOL[dtype_name], f"rank {r}: residual error {err.max()} > {RTOL[dtype_name]}"
    ref = got_res / np.sqrt(np.mean(got_res * got_res, axis=-1, keepdims=True) + eps) * w
    bound = 2 * RTOL[dtype_name] * (np.abs(ref) + 1e-3 * np.abs(ref).max(axis=-1, keepdims=True)) + 1e-30
    assert np.all(np.abs(got - ref) <= bound), f"rank {r}: normed error {np.abs(got - ref).max()}"
  for name, got in (("normed", normed), ("residual", new_residual)):
    first = np.ascontiguousarray(got[0]).view(np.uint8)
    for r in range(1, got.shape[0]):
      assert np.array_equal(first, np.ascontiguousarray(got[r]).view(np.uint8)), f"{name}: rank {r} differs in bits"


def check_residual_rmsnorm_case(mesh, rng: np.random.Generator, rows: int, hidden: int, dtype_name: str,
                                eps: float = 1e-6) -> None:
  """One all_reduce_residual_rmsnorm on ``mesh`` (axis "x") of fresh random
  inputs, every rank's results against float64 (assert_residual_rmsnorm_matches)."""
  shards, residual, weight = residual_rmsnorm_inputs(rng, mesh.devices.size, rows, hidden, dtype_name)
  normed, new_residual = residual_rmsnorm_fn(mesh, eps)(jax.device_put(shards, NamedSharding(mesh, P("x"))),
                                                        residual, weight)
  assert_residual_rmsnorm_matches(np.asarray(normed), np.asarray(new_residual), shards, residual, weight, eps,
                                  dtype_name)


# The ops independent_calls runs, each on one row of ``elems`` float32, returning a row of the same
# size; independent_wrong checks what each returned.
INDEPENDENT_OPS = ("all_reduce", "dcp_a2a", "residual_rmsnorm")
# independent dcp_a2a: a row is out [1, elems // 128, 128], round(row / 8) in bfloat16 (integers within
# 125: exact), and lse row[..., 0] / 128 (exact in float32); one batch row, as the Triton kernel takes it.
DCP_ROW = (1, 128)
FUSED_RESIDUAL = 7.0  # independent residual_rmsnorm: the residual every rank adds (exact in float32)
FUSED_EPS = 1e-6


def _independent_op(op: str):
  """One row's call of ``op`` (INDEPENDENT_OPS) over axis "x"."""
  import jax.numpy as jnp

  import b12x_jax
  if op == "all_reduce":
    return lambda r: b12x_jax.all_reduce(r, "x")
  if op == "residual_rmsnorm":  # the new residual's first half, then the normed output's second half
    def fused(r):
      normed, residual = b12x_jax.all_reduce_residual_rmsnorm(r[None], jnp.full_like(r[None], FUSED_RESIDUAL),
                                                              jnp.ones_like(r), "x", eps=FUSED_EPS)
      half = r.size // 2
      return jnp.concatenate([residual[0, :half], normed[0, half:]])
    return fused
  batch, dim = DCP_ROW

  def merge(r):  # this rank's head shard, flat, then zeros to the row's size
    partial = r.reshape(batch, -1, dim)
    out = jnp.round(partial / 8).astype(jnp.bfloat16)
    merged = b12x_jax.dcp_a2a(out, partial[..., 0] / 128, "x").reshape(-1).astype(r.dtype)
    return jnp.concatenate([merged, jnp.zeros(r.size - merged.size, r.dtype)])
  return merge


def independent_calls(calls: int, op: str = "all_reduce"):
  """A shard_map body: ``calls`` calls of ``op`` (INDEPENDENT_OPS) on one
  channel over axis "x" whose inputs do not depend on each other (x:
  [calls, elems], one row each), a quarter straight, a quarter in a scan
  body, a quarter in a while_loop body and a quarter in the taken branch of
  a cond (DESIGN C15: program order inside control flow too)."""
  import jax.numpy as jnp
  quarter = calls // 4
  call = _independent_op(op)

  def each(rows):
    return jnp.stack([call(r) for r in rows])

  def body(x):
    straight = each(x[:quarter])
    scanned = jax.lax.scan(lambda c, xs: (c, each(xs)), 0, x[None, quarter:2 * quarter])[1][0]
    looped = jax.lax.fori_loop(0, 1, lambda i, v: each(v), x[2 * quarter:3 * quarter])
    taken = jax.lax.cond(x[0, 0] > -1e9, each, lambda v: v * 0, x[3 * quarter:])
    return jnp.concatenate([straight, scanned, looped, taken])

  return body


def independent_wrong(op: str, got: np.ndarray, shards: np.ndarray, ranks: list[int] | None = None) -> int:
  """How many of independent_calls' results are wrong: ``got`` [calls,
  len(ranks), elems] holds the rows of ``ranks`` (default every rank) of
  every call, ``shards`` the integer inputs [calls, n, elems]. all_reduce
  and the fused op's new residual are exact, its normed output within
  float32 roundings of the float64 RMSNorm of that residual (another
  call's is off by far more); each element of a dcp_a2a
  merge must be within two bfloat16 roundings of the float64 merge of its
  own call's partials (one of another call's is off by tens or more)."""
  calls, n, elems = shards.shape
  ranks = list(range(n)) if ranks is None else ranks
  total = shards.sum(axis=1, dtype=np.float64)[:, None]
  if op == "all_reduce":
    return int((got != total).any(axis=2).sum())
  if op == "residual_rmsnorm":
    residual = total + FUSED_RESIDUAL
    normed = residual / np.sqrt(np.mean(residual * residual, axis=2, keepdims=True) + FUSED_EPS)
    half = elems // 2
    wrong_residual = (got[..., :half] != residual[..., :half]).any(axis=2)
    wrong_normed = (np.abs(got[..., half:] - normed[..., half:]) > 1e-5 * (1 + np.abs(normed[..., half:]))).any(axis=2)
    return int((wrong_residual | wrong_normed).sum())
  batch, dim = DCP_ROW
  partials = shards.reshape(calls, n, batch, -1, dim)
  outs = np.round(partials / 8).astype(np.float64)
  lses = partials[..., 0].astype(np.float64) / 128  # exact, as the call's float32 division
  weights = np.exp(lses - lses.max(axis=1, keepdims=True))
  merged = (weights[..., None] * outs).sum(axis=1) / weights.sum(axis=1)[..., None]  # [calls, B, H, D]
  heads = merged.shape[2] // n
  wrong = 0
  for row, r in enumerate(ranks):
    want = merged[:, :, r * heads:(r + 1) * heads].reshape(calls, -1)
    err = np.abs(got[:, row, :want.shape[1]] - want)
    wrong += int((~(err <= 2 * 2.0**-8 * np.abs(want) + 1e-3)).any(axis=1).sum())
  return wrong


def calls_taken(decisions) -> list[list]:
  """Each (op, path, kernel kind, protocol) the ``decisions`` name, once,
  sorted. The protocol, where the call runs on b12x: "lamport" (the fused
  op always), else an all_reduce's algorithm, else "barrier" (dcp_a2a's);
  None on another path."""
  import re
  taken = set()
  for d in decisions:
    protocol = None
    if d.path == "b12x":
      algorithm = re.search(r"; (one_shot_pull|one_shot|two_shot) \(", d.reason)
      if d.op == "all_reduce_residual_rmsnorm" or "the Lamport exchange" in d.reason or "; lamport (" in d.reason:
        protocol = "lamport"
      else:
        protocol = algorithm.group(1) if algorithm else "barrier"
    taken.add((d.op, d.path, d.kernel, protocol))
  return [list(t) for t in sorted(taken, key=str)]


def expected_taken(op: str, protocol: str, kernel: str = "ffi") -> list[list]:
  """What calls_taken gives for calls of ``op`` (INDEPENDENT_OPS) on
  ``protocol`` ("lamport", else the all_reduce algorithm of the barrier
  path, dcp_a2a's barrier, the fused op's unfused path)."""
  if op == "residual_rmsnorm":
    taken = [("all_reduce_residual_rmsnorm", "b12x", kernel, "lamport")] if protocol == "lamport" else [
        ("all_reduce", "b12x", "ffi", protocol), ("all_reduce_residual_rmsnorm", "unfused", None, None)]
  elif op == "dcp_a2a":
    taken = [(op, "b12x", kernel, "lamport" if protocol == "lamport" else "barrier")]
  else:
    taken = [(op, "b12x", kernel, protocol)]
  return [list(t) for t in sorted(taken, key=str)]


def integer_shards(rng: np.random.Generator, calls: int, n: int, elems: int) -> np.ndarray:
  """[calls, n, elems] random integers as float32 (never all zero): every
  float32 sum of them is exact, so a result is right or visibly wrong."""
  return rng.integers(-1000, 1000, size=(calls, n, elems)).astype(np.float32)


def lower_for_cuda(fn, args, monkeypatch) -> str:
  """The StableHLO text of jitted ``fn`` on ``args`` lowered for CUDA on
  this CPU-only host. Pallas Triton asks the local GPU for its compute
  capability while lowering; here it is told an H200's (a private module
  of jax 0.11 and 0.12: jax._src.pallas.triton.pallas_call_registration)."""
  from jax._src.pallas.triton import pallas_call_registration
  from jax.experimental.pallas import triton as plt
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                      lambda: plt.get_gpu_info_from_version(plt.GpuVersion.H200))
  return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def check_a_failed_call_leaves_later_calls_right(mesh, elems: int) -> None:
  """A compiled executable run after its channel's release fails with "not
  prepared"; the jitted function it was compiled from then traces again,
  prepares the channel and runs right 20 times, check_errors reports
  nothing, and the compiled executable runs right once the channel is
  prepared (a failed execution taints no later one). For
  tests/test_lifetime.py and tests/mp_workers.py (across processes, on CPU
  and the rig)."""
  import pytest
  from jax.sharding import PartitionSpec as P

  import b12x_jax
  rng = np.random.default_rng(13)
  fresh = lambda: random_shards(rng, mesh.size, elems, np.float32)  # noqa: E731
  def put(shards):  # without a collective (NCCL refuses the rig's processes on one GPU)
    flat = shards.reshape(-1)
    return jax.make_array_from_callback(flat.shape, NamedSharding(mesh, P("x")), lambda index: flat[index])

  def run(f, shards):  # the rows of this process's devices
    return np.stack([np.asarray(s.data) for s in f(put(shards)).addressable_shards])
  with fresh_communicator(poison_outputs=True) as comm:
    fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with b12x_jax.channel("after-failure"):
      compiled = fn.lower(put(fresh())).compile()
      comm.release("after-failure")
      with pytest.raises(Exception, match="channel 'after-failure' is not prepared on device"):
        run(compiled, fresh())
      for _ in range(20):
        shards = fresh()
        assert_sum_matches(run(fn, shards), shards, "float32")
      comm.check_errors()
      shards = fresh()
      assert_sum_matches(run(compiled, shards), shards, "float32")
