"""dcp_a2a on the CPU backend (emulated host devices): the merge against
float64 attention over the whole KV, empty shards, lse bases, sharing a
channel with all_reduce, channel isolation, the all_to_all fallback, errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import b12x_jax
from b12x_jax import _compat
from conftest import run_worker
from helpers import (DTYPES, assert_merge_matches, assert_names_both_calls, assert_sum_matches, attention_shards,
                     fresh_communicator, random_shards)

MERGE_DTYPES = ["bfloat16", "float16"]


def _per_rank(mesh, **kwargs):
  """dcp_a2a inside shard_map: inputs [n*B, H, ...] split along the axis,
  results [n*B, H/n, ...] (each rank's head shard, stacked)."""
  def body(out, lse):
    results = b12x_jax.dcp_a2a(out, lse, "x", **kwargs)
    return results if kwargs.get("return_lse") else (results,)
  out_specs = (P("x"), P("x")) if kwargs.get("return_lse") else (P("x"),)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=out_specs))


def _put(mesh, host: np.ndarray):
  return jax.device_put(host.reshape((-1,) + host.shape[2:]), NamedSharding(mesh, P("x")))


def _run(fn, mesh, outs, lses):
  """Per-rank results, each [n, B, H/n, ...]."""
  n, batch = outs.shape[:2]
  return [np.asarray(r).reshape((n, batch) + r.shape[1:]) for r in fn(_put(mesh, outs), _put(mesh, lses))]


def _decision():
  return b12x_jax.get_communicator().decisions[-1]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype_name", MERGE_DTYPES)
@pytest.mark.parametrize("lse_base", ["e", "2"])
def test_merge_matches_float64_attention_over_all_kv(cpu_mesh, n, dtype_name, lse_base):
  mesh = cpu_mesh(n)
  fn = _per_rank(mesh, return_lse=True, lse_base=lse_base)
  rng = np.random.default_rng([n, len(dtype_name), len(lse_base)])
  with fresh_communicator(poison_outputs=True), b12x_jax.channel(f"dcp{n}"):
    for _ in range(3):  # fresh inputs each call, both staging slots
      outs, lses, want, want_lse = attention_shards(rng, n, 3, 4 * n, 16, DTYPES[dtype_name],
                                                    base2=lse_base == "2")
      got, got_lse = _run(fn, mesh, outs, lses)
      assert got.dtype == outs.dtype and got_lse.dtype == np.float32
      assert_merge_matches(got, got_lse, outs, want, want_lse, dtype_name)
    assert _decision().path == "b12x", _decision()


def test_poisoned_outputs_are_fully_overwritten(cpu_mesh):
  # poison_outputs: out and lse are NaN before the backend writes them; a row
  # left over fails assert_merge_matches (it rejects non-finite outputs).
  with fresh_communicator(poison_outputs=True):
    mesh = cpu_mesh(2)
    fn = _per_rank(mesh, return_lse=True)
    rng = np.random.default_rng(12)
    with b12x_jax.channel("poisoned"):
      for _ in range(2):
        outs, lses, want, want_lse = attention_shards(rng, 2, 3, 8, 16, jnp.bfloat16)
        got, got_lse = _run(fn, mesh, outs, lses)
        assert_merge_matches(got, got_lse, outs, want, want_lse, "bfloat16")
        assert np.isfinite(got_lse).all()
    assert _decision().path == "b12x", _decision()


@pytest.mark.parametrize("n", [2, 4])
def test_empty_shards_have_weight_zero_and_their_nan_payload_never_leaks(cpu_mesh, n):
  mesh = cpu_mesh(n)
  fn = _per_rank(mesh, return_lse=True)
  rng = np.random.default_rng(10 + n)
  heads = 2 * n
  # Shard 0 empty for (0, 0) and (1, n): head 0 lands on rank 0, head n on rank n/2. Nothing at all for (1, 1).
  outs, lses, want, want_lse = attention_shards(rng, n, 2, heads, 16, jnp.bfloat16, empty=((0, 0, 0), (0, 1, n)),
                                                all_empty=((1, 1),))
  assert np.isnan(outs[0, 0, 0]).all() and np.isneginf(lses[:, 1, 1]).all()
  # Poisoned: a row the merge never writes reads NaN, not the 0 it should hold.
  with fresh_communicator(poison_outputs=True), b12x_jax.channel(f"empty{n}"):
    got, got_lse = _run(fn, mesh, outs, lses)
  assert_merge_matches(got, got_lse, outs, want, want_lse, "bfloat16")
  assert (got[0, 1, 1] == 0).all() and np.isneginf(got_lse[0, 1, 1])


def test_nan_and_inf_lse_count_as_empty(cpu_mesh):
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(20)
  outs, lses, want, want_lse = attention_shards(rng, 2, 2, 4, 16, jnp.bfloat16, empty=((1, 0, 0), (1, 1, 3)))
  lses[1, 0, 0], lses[1, 1, 3] = np.nan, np.inf  # same rows as the empty ones: the reference stands
  with b12x_jax.channel("nonfinite"):
    got, got_lse = _run(_per_rank(mesh, return_lse=True), mesh, outs, lses)
  assert_merge_matches(got, got_lse, outs, want, want_lse, "bfloat16")


def test_without_return_lse_gives_the_merged_out_alone(cpu_mesh):
  mesh = cpu_mesh(2)
  outs, lses, want, want_lse = attention_shards(np.random.default_rng(21), 2, 2, 4, 16, np.float16)
  with b12x_jax.channel("no-lse"):
    (got,) = _run(_per_rank(mesh), mesh, outs, lses)
  assert got.shape == (2, 2, 2, 16)
  assert_merge_matches(got, None, outs, want, want_lse, "float16")


def test_interleaves_with_all_reduce_on_one_channel_in_one_jit(cpu_mesh):
  # Decode with DCP and tensor parallelism: merge the heads, project this rank's heads (row-parallel
  # out-projection), sum over ranks; an all_reduce before and after the merge on the same channel.
  n, batch, heads, dim, model = 2, 2, 4, 16, 32
  mesh = cpu_mesh(n)
  rng = np.random.default_rng(22)
  weight = rng.standard_normal((heads * dim, model)).astype(np.float32) / 8

  def body(x, out, lse, w):
    y = b12x_jax.all_reduce(x, "x")
    # Chained on y so every rank issues the calls in one order.
    merged = b12x_jax.dcp_a2a(out + (0 * y[0]).astype(out.dtype), lse, "x")
    projected = merged.reshape(batch, -1).astype(jnp.float32) @ w
    return y, b12x_jax.all_reduce(projected, "x")

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x"), P("x"), P("x")), out_specs=(P("x"), P("x"))))
  comm = b12x_jax.get_communicator()
  with b12x_jax.channel("shared"):
    for call in range(1, 3):
      x = random_shards(rng, n, 64, np.float32)
      outs, lses, want, _ = attention_shards(rng, n, batch, heads, dim, jnp.bfloat16, empty=((1, 0, 2),))
      y, z = fn(_put(mesh, x), _put(mesh, outs), _put(mesh, lses), jax.device_put(weight, NamedSharding(mesh, P("x"))))
      assert_sum_matches(np.asarray(y).reshape(n, -1), x, "float32")
      z = np.asarray(z).reshape(n, batch, model)
      np.testing.assert_allclose(z[0], want.reshape(batch, -1) @ weight, atol=0.05)
      assert np.array_equal(z[0], z[1])
      assert all(comm.stats("shared", d)["epoch"] == 3 * call for d in mesh.devices.flat)
  assert [d.op for d in list(comm.decisions)[-3:]] == ["all_reduce", "dcp_a2a", "all_reduce"]


@pytest.mark.parametrize("batch, heads, dim", [(0, 4, 16), (0, 4, 4), (2, 0, 16)])
def test_an_empty_merge_beside_an_all_reduce_gives_empty_results_of_the_merges_type(cpu_mesh, batch, heads, dim):
  # An empty all_to_all, or an empty call of ours, beside another collective segfaults XLA:CPU's compiler
  # (jax 0.11.2): the empty merge runs no collective. (0, 4, 4): rows of 8 bytes, the fallback's shape.
  n = 2
  mesh = jax.make_mesh((n, 2), ("x", "y"), devices=jax.devices("cpu")[:4])
  rng = np.random.default_rng(23)

  def body(x, out, lse):
    return b12x_jax.all_reduce(x, "x"), *b12x_jax.dcp_a2a(out, lse, "x", return_lse=True)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x"), P("x", "y")),
                             out_specs=(P("x"), P("x", "y"), P("x", "y"))))  # the merge varies as lse does
  out = jax.device_put(np.ones((n * batch, heads, dim), jnp.bfloat16), NamedSharding(mesh, P("x")))
  lse = jax.device_put(np.zeros((n * batch, 2 * heads), np.float32), NamedSharding(mesh, P("x", "y")))
  channel = f"empty-merge-{batch}-{heads}-{dim}"
  with b12x_jax.channel(channel):
    for call in range(1, 3):
      x = random_shards(rng, n, 64, np.float32)
      total, merged, merged_lse = jax.block_until_ready(fn(_put(mesh, x), out, lse))  # every replica's call
      assert_sum_matches(np.asarray(total).reshape(n, -1), x, "float32")
      assert merged.shape == (n * batch, 2 * heads // n, dim) and merged.dtype == jnp.bfloat16
      assert merged_lse.shape == (n * batch, 2 * heads // n) and merged_lse.dtype == np.float32
      epochs = [b12x_jax.get_communicator().stats(channel, d)["epoch"] for d in mesh.devices.flat]
      assert epochs == [call] * 4, (epochs, b12x_jax.get_communicator().decisions[-2:])  # the all_reduce's alone
  # Traced only (the fallback's empty all_to_all beside the all_reduce is what segfaults): the types of
  # the fallback, with out varying over fewer axes than lse, and over more.
  wide_out = jax.device_put(np.ones((n * batch, 2 * heads, dim), jnp.bfloat16), NamedSharding(mesh, P("x", "y")))
  narrow_lse = jax.device_put(np.zeros((n * batch, heads), np.float32), NamedSharding(mesh, P("x")))
  for args, specs, lse_axes in (((out, lse), (P("x"), P("x", "y")), {"x", "y"}),
                                ((wide_out, narrow_lse), (P("x", "y"), P("x")), {"x"})):
    seen = []

    def types(out, lse):
      ours = b12x_jax.dcp_a2a(out, lse, "x", return_lse=True)
      theirs = b12x_jax.ops.dcp_a2a._all_to_all_path(out, lse, axis_name="x", base2=False, return_lse=True)
      seen.extend(zip(map(jax.typeof, ours), map(jax.typeof, theirs)))
      return ours[0]

    jax.jit(jax.shard_map(types, mesh=mesh, in_specs=specs, out_specs=P("x", "y"))).trace(*args)
    assert len(seen) == 2 and all(ours == theirs for ours, theirs in seen), seen
    assert _compat.varying_axes(seen[0][0]) == {"x", "y"} and _compat.varying_axes(seen[1][0]) == lse_axes, seen


def test_target_and_draft_lower_to_their_channels_and_advance_their_counters(cpu_mesh):
  mesh = cpu_mesh(2)
  fn = _per_rank(mesh)
  comm = b12x_jax.get_communicator()
  rng = np.random.default_rng(23)
  outs, lses, _, _ = attention_shards(rng, 2, 2, 4, 16, jnp.bfloat16)
  for name in ("dcp-target", "dcp-draft"):
    with b12x_jax.channel(name):
      text = fn.lower(_put(mesh, outs), _put(mesh, lses)).as_text()
    assert re.findall(r'channel_id = "([^"]+)"', text) == [name]
    assert "@b12x_dcp_a2a" in text and "has_side_effect = true" not in text
  calls = {"dcp-target": 0, "dcp-draft": 0}
  for name in ["dcp-target", "dcp-draft", "dcp-target", "dcp-target"]:
    outs, lses, want, want_lse = attention_shards(rng, 2, 2, 4, 16, jnp.bfloat16)
    with b12x_jax.channel(name):
      (got,) = _run(fn, mesh, outs, lses)
    assert_merge_matches(got, None, outs, want, want_lse, "bfloat16")
    calls[name] += 1
    for channel, count in calls.items():
      for device in mesh.devices.flat:
        assert comm.stats(channel, device)["epoch"] == count


def test_cuda_lowering_carries_the_channel_and_the_lse_base_without_a_gpu(cpu_mesh):
  mesh = cpu_mesh(2)
  fn = jax.jit(jax.shard_map(lambda o, l: b12x_jax.dcp_a2a(o, l, "x", lse_base="2", return_lse=True), mesh=mesh,
                             in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
  out = jax.ShapeDtypeStruct((2 * 2, 4, 16), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
  lse = jax.ShapeDtypeStruct((2 * 2, 4), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  with b12x_jax.channel("target"):
    text = fn.trace(out, lse).lower(lowering_platforms=("cuda",)).as_text()
  assert "@b12x_dcp_a2a" in text
  assert re.findall(r'channel_id = "([^"]+)"', text) == ["target"]
  assert "base2 = true" in text and "return_lse = true" in text


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("why", ["policy", "misaligned"])
def test_all_to_all_fallback_matches_the_reference(cpu_mesh, n, why):
  mesh = cpu_mesh(n)
  comm = b12x_jax.get_communicator()
  dim = 16 if why == "policy" else 12  # 12 bf16 = 24 bytes a row: not a multiple of 16
  rng = np.random.default_rng([30, n, dim])
  outs, lses, want, want_lse = attention_shards(rng, n, 2, 2 * n, dim, jnp.bfloat16, base2=True,
                                                empty=((0, 0, 0),), all_empty=((1, 1),))
  if why == "policy":
    comm.policy = "psum"
  try:
    with b12x_jax.channel("fallback"):
      got, got_lse = _run(_per_rank(mesh, return_lse=True, lse_base="2"), mesh, outs, lses)
  finally:
    comm.policy = "auto"
  decision = _decision()
  assert decision.path == "all_to_all", decision
  assert ("forces the all_to_all path" if why == "policy" else "row of out of 24 bytes") in decision.reason
  assert_merge_matches(got, got_lse, outs, want, want_lse, "bfloat16")


def test_rows_above_the_staging_capacity_fall_back(cpu_mesh):
  comm = b12x_jax.get_communicator()
  saved, comm.capacity_bytes = comm.capacity_bytes, 1024  # decisions read it at trace time
  try:
    mesh = cpu_mesh(2)
    # 4 rows of 512 bytes per source: above the staging and the Lamport window (clamped to the capacity).
    outs, lses, want, want_lse = attention_shards(np.random.default_rng(31), 2, 2, 4, 256, jnp.bfloat16)
    with b12x_jax.channel("big-rows"):
      (got,) = _run(_per_rank(mesh), mesh, outs, lses)
  finally:
    comm.capacity_bytes = saved
  assert _decision().path == "all_to_all" and "exceeds capacity_bytes=1024" in _decision().reason
  assert_merge_matches(got, None, outs, want, want_lse, "bfloat16")


def test_more_heads_than_a_call_tag_carries_fall_back(cpu_mesh):
  # The tag's 15 bits of H: beyond them two shapes would share a tag (and a cell layout), so peers at
  # other shapes could merge each other's rows without an error. B=1, H=32768 of 16-byte rows.
  mesh = cpu_mesh(2)
  outs, lses, want, want_lse = attention_shards(np.random.default_rng(33), 2, 1, 32768, 8, jnp.bfloat16, kv=2)
  with b12x_jax.channel("many-heads"):
    (got,) = _run(_per_rank(mesh), mesh, outs, lses)
  assert _decision().path == "all_to_all" and "a b12x call tag carries at most 32767 heads" in _decision().reason
  assert_merge_matches(got, None, outs, want, want_lse, "bfloat16")


def test_misaligned_rows_under_strict_policy_are_a_clear_error(cpu_mesh):
  mesh = cpu_mesh(2)
  comm = b12x_jax.get_communicator()
  outs, lses, _, _ = attention_shards(np.random.default_rng(32), 2, 1, 2, 12, jnp.bfloat16)
  comm.policy = "strict"
  try:
    with pytest.raises(b12x_jax.IneligibleError,
                       match=r"dcp_a2a: row of out of 24 bytes is not a multiple of 16 .*fall back to all_to_all"):
      _run(_per_rank(mesh), mesh, outs, lses)
  finally:
    comm.policy = "auto"


def test_one_device_axis_merges_locally(cpu_mesh):
  mesh = cpu_mesh(1)
  outs, lses, want, want_lse = attention_shards(np.random.default_rng(33), 1, 2, 2, 16, jnp.bfloat16,
                                                all_empty=((0, 1),))
  got, got_lse = _run(_per_rank(mesh, return_lse=True), mesh, outs, lses)
  assert_merge_matches(got, got_lse, outs, want, want_lse, "bfloat16")
  for batch in (2, 0):  # an empty batch has the type of a full one: the local merge, not the empty path
    merge = jax.jit(jax.shard_map(lambda o, l: b12x_jax.dcp_a2a(o, l, "x", return_lse=True), mesh=mesh,
                                  in_specs=(P(), P()), out_specs=(P(), P())))
    got, got_lse = merge(np.ones((batch, 2, 16), jnp.bfloat16), np.zeros((batch, 2), np.float32))
    assert got.shape == (batch, 2, 16) and got_lse.shape == (batch, 2)


@pytest.mark.parametrize("out_shape, out_dtype, lse_shape, lse_dtype, kwargs, error, match", [
    ((2, 5, 16), jnp.bfloat16, (2, 5), jnp.float32, {}, ValueError,
     r"dcp_a2a: H=5 heads must be a multiple of the 2 devices of axis 'x'; pad the heads"),
    ((2, 4, 16), jnp.float32, (2, 4), jnp.float32, {}, TypeError,
     r"dcp_a2a: out must be bfloat16 or float16, got float32; cast it"),
    ((2, 4, 16), jnp.bfloat16, (2, 4), jnp.bfloat16, {}, TypeError,
     r"dcp_a2a: lse must be float32, got bfloat16; cast it"),
    ((2, 64), jnp.bfloat16, (2, 4), jnp.float32, {}, ValueError,
     r"dcp_a2a: out must be \[B, H, D\] \(3 dims\), got shape \(2, 64\)"),
    ((2, 4, 16), jnp.bfloat16, (2, 2), jnp.float32, {}, ValueError,
     r"dcp_a2a: lse must have shape out.shape\[:2\] = \(2, 4\) \(\[B, H\]\), got \(2, 2\)"),
    ((2, 4, 16), jnp.bfloat16, (2, 4), jnp.float32, {"lse_base": "10"}, ValueError,
     r"dcp_a2a: lse_base must be 'e' \(natural log\) or '2' \(log2\), got '10'"),
    # XLA crashed the process compiling it (its partitioner, psum's all_to_all path too)
    ((2, 4, 0), jnp.bfloat16, (2, 4), jnp.float32, {}, ValueError,
     r"dcp_a2a: out must have a head_dim D of at least 1, got shape \(2, 4, 0\)"),
])
def test_bad_arguments_are_clear_errors(cpu_mesh, out_shape, out_dtype, lse_shape, lse_dtype, kwargs, error, match):
  mesh = cpu_mesh(2)
  fn = jax.jit(jax.shard_map(lambda o, l: b12x_jax.dcp_a2a(o, l, "x", **kwargs), mesh=mesh,
                             in_specs=(P("x"), P("x")), out_specs=P("x")))
  out = jax.ShapeDtypeStruct((2 * out_shape[0],) + out_shape[1:], out_dtype, sharding=NamedSharding(mesh, P("x")))
  lse = jax.ShapeDtypeStruct((2 * lse_shape[0],) + lse_shape[1:], lse_dtype, sharding=NamedSharding(mesh, P("x")))
  with pytest.raises(error, match=match):
    fn.trace(out, lse)


def test_a_peer_that_never_joins_a_merge_times_out_with_names():
  result = run_worker("timeout", "--platform", "cpu", "--op", "dcp_a2a", "--timeout", "1.0", hard_timeout=120)
  assert len(result["messages"]) == 2, result
  for message in result["messages"]:
    assert re.search(r"channel 'lonely' rank 0 timed out after 1 s at epoch 1 waiting for rank 1", message), message
  assert result["seconds"] < 30


@pytest.mark.parametrize("lamport_bytes, how", [(1 << 20, "lamport, "), (0, "")], ids=["lamport", "barrier"])
def test_ranks_at_merges_of_other_heads_raise_a_clear_error(lamport_bytes, how):
  # Rank 0 merges out [1, 32, 256] and rank 1 [2, 16, 256] on one channel: one size, one block, other
  # heads. The call tag tells them apart: both stop with an error naming both calls, never a merge of
  # mixed rows, never a hang.
  result = run_worker("mismatch", "--platform", "cpu", "--timeout", "5.0", "--op", "dcp_a2a",
                      "--lamport-bytes", str(lamport_bytes), hard_timeout=120)
  assert result["finite"] is None and result["seconds"] < 5, result  # on CPU the call itself raises, at once
  assert_names_both_calls(result["messages"], {
      0: f"dcp_a2a of 16384 bytes \\(bfloat16, 32 heads of 512 bytes, lse base e, {how}grid 1\\)",
      1: f"dcp_a2a of 16384 bytes \\(bfloat16, 16 heads of 512 bytes, lse base e, {how}grid 1\\)"})
