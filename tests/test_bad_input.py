"""Bad input to every public function, on the CPU backend (emulated host
devices): wrong dtypes, shapes, axes, channel names and settings give errors
that name the op, the offending argument and the fix, or a psum/all_to_all
fallback whose result is right; NaN and Inf payloads follow float64 NumPy
position by position; payloads at, just below and just above the staging
capacity take the path ``decisions`` records, and are right. After every
error the library is still usable on the same channel."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import b12x_jax
from b12x_jax import _compat
from conftest import run_worker
from helpers import (DTYPES, RTOL, assert_merge_matches, assert_sum_matches, attention_shards, fresh_communicator,
                     installed, mount_namespace, put_sharded, random_shards)

CHANNEL = "bad-input"  # plus the axis size: a device serves a channel in one group only
LSE_BYTES = 4  # one float32 lse per staged row of dcp_a2a
PACK = 16


# -- helpers ---------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _own_communicator():
  """Each test starts on a new communicator of policy "auto", not on
  whatever an earlier test left active, and leaves a default one."""
  b12x_jax.get_communicator().close()
  b12x_jax.set_communicator(b12x_jax.Communicator(policy="auto"))
  yield
  b12x_jax.get_communicator().close()
  b12x_jax.set_communicator(b12x_jax.Communicator())


def _all_reduce_fn(mesh, shape: tuple[int, ...] | None = None, axis="x", **kwargs):
  """all_reduce inside shard_map: rank r's input is row r of [n, elems]
  (viewed as ``shape`` inside, if given); returns [n * elems] (each rank's
  result, stacked)."""
  def body(x):
    y = x if shape is None else x.reshape(shape)
    return b12x_jax.all_reduce(y, axis, **kwargs).reshape(x.shape)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def _channel(mesh) -> str:
  return f"{CHANNEL}{mesh.shape['x']}"


def _all_reduce(mesh, shards: np.ndarray, *, shape: tuple[int, ...] | None = None, channel: str | None = None,
                **kwargs) -> np.ndarray:
  """Every rank's all_reduce of ``shards`` [n, elems] on ``channel`` (the
  test channel of the mesh by default), as [n, elems]."""
  with b12x_jax.channel(channel or _channel(mesh)):
    out = _all_reduce_fn(mesh, shape, **kwargs)(put_sharded(mesh, shards))
  return np.asarray(out).reshape(shards.shape)


def _dcp_fn(mesh, axis="x", **kwargs):
  """dcp_a2a inside shard_map with return_lse: inputs [n*B, H, ...], results
  [n*B, H/n, ...]."""
  return jax.jit(jax.shard_map(lambda o, l: b12x_jax.dcp_a2a(o, l, axis, return_lse=True, **kwargs), mesh=mesh,
                               in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))


def _dcp(mesh, outs: np.ndarray, lses: np.ndarray, *, channel: str | None = None, **kwargs):
  """Every rank's merge of ``outs`` [n, B, H, D] and ``lses`` [n, B, H]:
  ([n, B, H/n, D], [n, B, H/n])."""
  n, batch, heads, dim = outs.shape
  with b12x_jax.channel(channel or _channel(mesh)):
    got, got_lse = _dcp_fn(mesh, **kwargs)(put_sharded(mesh, outs), put_sharded(mesh, lses))
  return (np.asarray(got).reshape(n, batch, heads // n, dim), np.asarray(got_lse).reshape(n, batch, heads // n))


def _trace_dcp(mesh, out_shape, out_dtype, lse_shape, lse_dtype, axis="x", **kwargs) -> None:
  """Traces dcp_a2a on per-rank shapes (nothing runs) on the test channel."""
  n = mesh.shape["x"]
  fn = jax.jit(jax.shard_map(lambda o, l: b12x_jax.dcp_a2a(o, l, axis, **kwargs), mesh=mesh,
                             in_specs=(P("x"), P("x")), out_specs=P("x")))
  sharding = NamedSharding(mesh, P("x"))
  out = jax.ShapeDtypeStruct((n * out_shape[0],) + tuple(out_shape[1:]), out_dtype, sharding=sharding)
  lse = jax.ShapeDtypeStruct((n * lse_shape[0],) + tuple(lse_shape[1:]), lse_dtype, sharding=sharding)
  with b12x_jax.channel(_channel(mesh)):
    fn.trace(out, lse)


def _decision() -> b12x_jax.Decision:
  return b12x_jax.get_communicator().decisions[-1]


def _assert_still_usable(mesh, channel: str | None = None) -> None:
  """A correct all_reduce on ``channel`` (the mesh's test channel) takes
  the b12x path and gives the float64 sum: an error before it left nothing
  broken."""
  shards = random_shards(np.random.default_rng(99), mesh.shape["x"], 64, np.float32)
  assert_sum_matches(_all_reduce(mesh, shards, channel=channel), shards, "float32")
  assert _decision().path == "b12x", _decision()


def _assert_names(message: str, who: str, argument: str, fix: str | None = None) -> None:
  """``message`` names ``who`` (the op, e.g. "b12x_jax.all_reduce"), the
  ``argument`` (a regex) and, if given, the ``fix`` (a regex)."""
  assert who in message, f"{who!r} not named in: {message}"
  assert re.search(argument, message), f"argument /{argument}/ not named in: {message}"
  if fix is not None:
    assert re.search(fix, message), f"fix /{fix}/ not given in: {message}"


def _reason(message: str) -> str:
  """What a strict-policy IneligibleError says is wrong (before its generic fix list)."""
  return message.split(" (policy 'strict')")[0]


# -- all_reduce: dtypes, shapes, arguments -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int32, np.int16, np.uint32])
def test_integer_payloads_fall_back_to_psum_and_are_exact(cpu_mesh, dtype):
  mesh = cpu_mesh(2)
  shards = np.random.default_rng(1).integers(-1000, 1000, size=(2, 16)).astype(dtype)
  out = _all_reduce(mesh, shards)
  assert out.dtype == dtype and (out == shards.sum(0, dtype=dtype)).all()
  assert _decision().path == "psum" and f"dtype {np.dtype(dtype).name}" in _decision().reason, _decision()
  _assert_still_usable(mesh)


@pytest.mark.parametrize("shape, path", [
    ((), "psum"),            # 4 bytes
    ((2, 3), "psum"),        # 24 bytes
    ((3, 5, 4), "b12x"),     # 240 bytes
    ((2, 1, 2, 2, 1), "b12x"),  # 16 bytes, 5 dims
])
def test_scalars_and_any_rank_reduce_right(cpu_mesh, shape, path):
  mesh = cpu_mesh(2)
  shards = random_shards(np.random.default_rng(2), 2, math.prod(shape), np.float32)
  out = _all_reduce(mesh, shards, shape=shape)
  assert_sum_matches(out, shards, "float32", roundings=1 if path == "b12x" else 2)
  assert _decision().path == path, _decision()


@pytest.mark.parametrize("shape", [(0,), (4, 0)])
def test_an_empty_payload_gives_an_empty_result_and_leaves_the_channel_usable(cpu_mesh, shape):
  mesh = cpu_mesh(2)
  for _ in range(2):  # both staging slots
    out = _all_reduce(mesh, np.zeros((2, 0), np.float32), shape=shape)
    assert out.shape == (2, 0)
  _assert_still_usable(mesh)


def test_an_empty_leaf_beside_a_full_one_sums_right_and_has_psums_type(cpu_mesh):
  # An empty psum beside another all-reduce segfaults XLA:CPU (jax 0.11.2): the empty sum runs no collective.
  mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices("cpu")[:4])
  shards = random_shards(np.random.default_rng(5), 2, 64, np.float32)

  def step(a, e, flags, grid):
    total, empty, empty_flags = b12x_jax.all_reduce((a, e, flags), "x")
    return total, empty, empty_flags, b12x_jax.all_reduce(grid, "x")

  fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("x"), P("x"), P("x"), P("x", "y")),
                             out_specs=(P(("x", "y")), P(), P(), P(None, "y"))))
  grid = jax.device_put(np.zeros((2, 2, 0), np.float32), NamedSharding(mesh, P("x", "y")))
  leaves = (put_sharded(mesh, shards), put_sharded(mesh, np.zeros((2, 0), np.float32)),
            put_sharded(mesh, np.zeros((2, 0), bool)), grid)
  with b12x_jax.channel(_channel(mesh)):
    for _ in range(2):  # both staging slots
      total, empty, empty_flags, empty_grid = fn(*leaves)
      assert_sum_matches(np.asarray(total).reshape(4, 64), shards, "float32")  # every device's copy
      assert empty.shape == (0,) and empty.dtype == np.float32
      assert empty_flags.shape == (0,) and empty_flags.dtype == np.int32  # psum sums bools as int32
      assert empty_grid.shape == (1, 2, 0)
  seen = []  # traced only: the empty psum beside the other all-reduce is what segfaults

  def types(a, e, flags, grid):
    ours = b12x_jax.all_reduce((a, e, flags, grid), "x")
    theirs = jax.lax.psum((a, e, flags, grid), "x")
    seen.extend(zip(map(jax.typeof, ours), map(jax.typeof, theirs)))
    return ours[0]

  jax.jit(jax.shard_map(types, mesh=mesh, in_specs=(P("x"), P("x"), P("x"), P("x", "y")), out_specs=P())).trace(*leaves)
  assert len(seen) == 4 and all(ours == theirs for ours, theirs in seen), seen
  assert _compat.varying_axes(seen[-1][0]) == {"y"}, seen


@pytest.mark.parametrize("x, kind", [("1", "str"), (object(), "object"), (np.array(["a"]), "ndarray of dtype <U1"),
                                     (jax.ShapeDtypeStruct((2,), np.float32), "ShapeDtypeStruct of dtype float32")])
def test_an_operand_that_is_not_an_array_is_a_clear_error(cpu_mesh, x, kind):
  mesh = cpu_mesh(2)
  fn = jax.jit(jax.shard_map(lambda y: y + b12x_jax.all_reduce(x, "x")[0], mesh=mesh, in_specs=P("x"),
                             out_specs=P("x")))
  with b12x_jax.channel(_channel(mesh)), pytest.raises(TypeError) as info:
    fn(jax.device_put(np.ones(4, np.float32), NamedSharding(mesh, P("x"))))
  message = str(info.value)
  assert "b12x_jax.all_reduce" in message, message
  assert re.search(rf"x must be an array.*got {kind}", message), message
  _assert_still_usable(mesh)


@pytest.mark.parametrize("x", [(), [None], {}, {"a": []}])
def test_an_empty_pytree_comes_back_as_psum_gives_it(cpu_mesh, x):
  mesh = cpu_mesh(2)
  def body(y):
    assert b12x_jax.all_reduce(x, "x") == jax.lax.psum(x, "x") == x
    return y
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  with b12x_jax.channel(_channel(mesh)):
    np.testing.assert_array_equal(np.asarray(fn(jax.device_put(np.ones(4, np.float32),
                                                               NamedSharding(mesh, P("x"))))), np.ones(4))


@pytest.mark.parametrize("x", [[1.0, 2.0], 3.0, (np.float32(2.0), {"a": 4})])
def test_numbers_and_pytrees_of_them_sum_as_psum_sums_them(cpu_mesh, x):
  mesh = cpu_mesh(2)
  def body(y):
    ours, theirs = b12x_jax.all_reduce(x, "x"), jax.lax.psum(x, "x")
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    # |a - b| per leaf: a signed sum would let two wrong leaves cancel
    return y + sum(jnp.sum(jnp.abs(a - b)) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)))
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  with b12x_jax.channel(_channel(mesh)):
    np.testing.assert_array_equal(np.asarray(fn(jax.device_put(np.ones(4, np.float32),
                                                               NamedSharding(mesh, P("x"))))), np.ones(4))
  _assert_still_usable(mesh)


@pytest.mark.parametrize("op, axis, error, what", [
    (op, *case) for op in ("all_reduce", "dcp_a2a") for case in [
        ("y", ValueError, r"unknown axis_name 'y'"),
        (None, TypeError, r"axis_name must be one mesh axis name \(a str\), got None"),
        (0, TypeError, r"axis_name must be one mesh axis name \(a str\), got 0"),
    ]] + [("dcp_a2a", ("x",), TypeError, r"axis_name must be one mesh axis name \(a str\), got \('x',\)")])
def test_an_axis_that_is_not_one_bound_mesh_axis_name_is_a_clear_error(cpu_mesh, op, axis, error, what):
  # all_reduce takes a tuple of axes, as psum does (tests/test_drop_in.py); dcp_a2a merges over one axis.
  mesh = cpu_mesh(2)
  with pytest.raises(error) as info:
    if op == "all_reduce":
      with b12x_jax.channel(_channel(mesh)):
        _all_reduce_fn(mesh, axis=axis).trace(jax.ShapeDtypeStruct((2 * 16,), jnp.float32,
                                                                    sharding=NamedSharding(mesh, P("x"))))
    else:
      _trace_dcp(mesh, (2, 4, 64), jnp.bfloat16, (2, 4), jnp.float32, axis=axis)
  _assert_names(str(info.value), f"b12x_jax.{op}", what, fix=r"shard_map" if error is ValueError else r"a str")
  _assert_still_usable(mesh)


def test_an_axis_named_twice_is_a_clear_error(cpu_mesh):
  # XLA aborted the process (psum too: "axes overlap")
  mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices("cpu")[:4])
  for axes in (("x", "x"), ["y", "x", "y"]):
    with pytest.raises(ValueError) as info:
      jax.jit(jax.shard_map(lambda v, axes=axes: b12x_jax.all_reduce(v, axes), mesh=mesh, in_specs=P("x", "y"),
                            out_specs=P())).trace(jax.ShapeDtypeStruct((4, 4), jnp.float32,
                                                                       sharding=NamedSharding(mesh, P("x", "y"))))
    _assert_names(str(info.value), "b12x_jax.all_reduce", rf"axis_name {re.escape(repr(axes))} names an axis twice",
                  fix="name each axis once")
  _assert_still_usable(cpu_mesh(2))


@pytest.mark.parametrize("bad", ["", "a b", 5])
def test_a_bad_channel_argument_of_a_sum_of_constants_is_a_clear_error(cpu_mesh, bad):
  # psum sums constants while tracing, with no channel; the name was not checked
  mesh = cpu_mesh(2)
  with pytest.raises(b12x_jax.ChannelError) as info:
    jax.jit(jax.shard_map(lambda v: v + b12x_jax.all_reduce(1.0, "x", channel=bad), mesh=mesh, in_specs=P("x"),
                          out_specs=P("x"))).trace(jax.ShapeDtypeStruct((4,), jnp.float32,
                                                                    sharding=NamedSharding(mesh, P("x"))))
  _assert_names(str(info.value), "b12x_jax.all_reduce(channel=...)", r"channel name must be 1-64 characters")
  _assert_still_usable(mesh)


@pytest.mark.parametrize("op", ["all_reduce", "dcp_a2a"])
def test_an_eager_call_outside_shard_map_is_a_clear_error(cpu_mesh, op):
  with pytest.raises(ValueError) as info:
    if op == "all_reduce":
      b12x_jax.all_reduce(np.ones(8, np.float32), "x")
    else:
      b12x_jax.dcp_a2a(np.ones((2, 4, 64), jnp.bfloat16), np.zeros((2, 4), np.float32), "x")
  _assert_names(str(info.value), f"b12x_jax.{op}", r"axis_name 'x'", fix=r"inside jax.shard_map")
  _assert_still_usable(cpu_mesh(2))


@pytest.mark.parametrize("op", ["all_reduce", "dcp_a2a"])
@pytest.mark.parametrize("bad", ["a b", "", "x" * 65, 7])
def test_a_bad_channel_argument_is_a_clear_error(cpu_mesh, op, bad):
  mesh = cpu_mesh(2)
  with pytest.raises(b12x_jax.ChannelError) as info:
    if op == "all_reduce":
      _all_reduce_fn(mesh, channel=bad).trace(jax.ShapeDtypeStruct((2 * 16,), jnp.float32,
                                                                   sharding=NamedSharding(mesh, P("x"))))
    else:
      _trace_dcp(mesh, (2, 4, 64), jnp.bfloat16, (2, 4), jnp.float32, channel=bad)
  _assert_names(str(info.value), f"b12x_jax.{op}(channel=...)", r"channel name must be 1-64 characters",
                fix=r"use a stable semantic name")
  _assert_still_usable(mesh)


# -- all_reduce: NaN and Inf --------------------------------------------------------------------------------------


def _specials(shards: np.ndarray, dtype) -> np.ndarray:
  """``shards`` [n, elems] with NaN, +-Inf and overflowing values in the
  first 8 positions (n >= 2); the rest stays finite and random."""
  x = shards.astype(np.float64)
  big = float(jnp.finfo(dtype).max)
  x[0, 0] = np.inf                        # inf + finite = inf
  x[0, 1], x[1, 1] = np.inf, -np.inf      # inf + -inf = nan
  x[1, 2] = np.nan                        # nan propagates
  x[:, 3] = -np.inf                       # -inf + -inf = -inf
  x[:, 4] = big                           # overflows the dtype: +inf
  x[:, 5] = -big                          # -inf
  x[0, 6], x[1, 6] = np.nan, np.inf       # nan wins over inf
  x[0, 7], x[1, 7] = big, -big            # cancels exactly in fp32 and float64
  return x.astype(dtype)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("path", ["b12x", "psum"])
def test_nan_and_inf_payloads_follow_float64_numpy_position_by_position(cpu_mesh, n, dtype_name, path):
  dtype = DTYPES[dtype_name]
  mesh = cpu_mesh(n)
  itemsize = np.dtype(dtype).itemsize
  elems = 256 // itemsize if path == "b12x" else 256 // itemsize - 1  # a multiple of 16 bytes, or not
  shards = _specials(random_shards(np.random.default_rng([n, itemsize]), n, elems, dtype), dtype)
  got = _all_reduce(mesh, shards).astype(np.float64)
  assert _decision().path == path, _decision()
  with np.errstate(invalid="ignore", over="ignore"):
    want = shards.astype(np.float64).sum(axis=0).astype(dtype).astype(np.float64)  # overflow to inf in dtype
  scale = np.nan_to_num(np.abs(shards.astype(np.float64)), nan=0.0, posinf=0.0).sum(axis=0) + 1e-30
  finite = np.isfinite(want)
  for r in range(n):
    assert np.array_equal(np.isnan(got[r]), np.isnan(want)), f"rank {r}: NaN at {np.flatnonzero(np.isnan(got[r]))}"
    inf = np.isinf(want)
    assert np.array_equal(got[r][inf], want[inf]), f"rank {r}: {got[r][inf]} where numpy gives {want[inf]}"
    assert np.isfinite(got[r][finite]).all(), f"rank {r}: non-finite where numpy is finite"
    err = np.abs(got[r][finite] - want[finite]) / scale[finite]
    assert err.max() <= RTOL[dtype_name] * (1 if path == "b12x" else n), f"rank {r}: relative error {err.max()}"
  if path == "b12x":
    first = np.ascontiguousarray(got[0]).view(np.uint64)
    assert all(np.array_equal(first, np.ascontiguousarray(g).view(np.uint64)) for g in got[1:]), "ranks differ"
  if path == "b12x" and dtype_name == "bfloat16":  # CUDA's canonical NaN (cvt.rn.bf16.f32), as the GPU kernels
    bits = np.asarray(_all_reduce(mesh, shards)).view(np.uint16)
    assert (bits[:, np.isnan(want)] == 0x7FFF).all(), bits[:, np.isnan(want)]
  _assert_still_usable(mesh)


# -- all_reduce at the staging capacity ---------------------------------------------------------------------------

CAPACITY = 4096


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("delta", [-16, 0])
def test_a_payload_up_to_the_capacity_runs_on_b12x_under_strict(cpu_mesh, n, dtype_name, delta):
  dtype = DTYPES[dtype_name]
  mesh = cpu_mesh(n)
  rng = np.random.default_rng([n, delta + 16])
  with fresh_communicator(capacity_bytes=CAPACITY, policy="strict"):
    for _ in range(2):  # fresh inputs, both staging slots
      shards = random_shards(rng, n, (CAPACITY + delta) // np.dtype(dtype).itemsize, dtype)
      assert_sum_matches(_all_reduce(mesh, shards), shards, dtype_name)
      decision = _decision()
      assert (decision.op, decision.channel, decision.path) == ("all_reduce", _channel(mesh), "b12x"), decision
      assert decision.reason.startswith("inside the b12x window"), decision


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_a_payload_16_bytes_above_the_capacity_is_an_error_under_strict(cpu_mesh, dtype_name):
  mesh = cpu_mesh(2)
  elems = (CAPACITY + 16) // np.dtype(DTYPES[dtype_name]).itemsize
  with fresh_communicator(capacity_bytes=CAPACITY, policy="strict"):
    with pytest.raises(b12x_jax.IneligibleError) as info:
      _all_reduce(mesh, random_shards(np.random.default_rng(4), 2, elems, DTYPES[dtype_name]))
    _assert_names(str(info.value), "b12x_jax.all_reduce", rf"{CAPACITY + 16} bytes .*capacity_bytes={CAPACITY}",
                  fix=r"Raise Communicator\(capacity_bytes=\.\.\.\) or split x into smaller calls, or use policy='auto'")
    _assert_still_usable(mesh)


@pytest.mark.parametrize("n", [2, 4])
def test_a_payload_16_bytes_above_the_capacity_falls_back_to_psum_under_auto(cpu_mesh, n):
  mesh = cpu_mesh(n)
  with fresh_communicator(capacity_bytes=CAPACITY, policy="auto"):
    shards = random_shards(np.random.default_rng(5), n, (CAPACITY + 16) // 4, np.float32)
    assert_sum_matches(_all_reduce(mesh, shards), shards, "float32", roundings=n)
    assert _decision().path == "psum" and f"exceeds capacity_bytes={CAPACITY}" in _decision().reason
    _assert_still_usable(mesh)


# -- strict-policy messages: the op, the argument, the fix --------------------------------------------------------


def _strict_all_reduce(mesh, dtype, elems):
  _all_reduce(mesh, random_shards(np.random.default_rng(6), 2, elems, dtype))


def _strict_dcp(mesh, batch, dim):
  outs, lses, _, _ = attention_shards(np.random.default_rng(7), 2, batch, 4, dim, jnp.bfloat16)
  _dcp(mesh, outs, lses)


@pytest.mark.parametrize("case, call, argument, fix", [
    pytest.param("misaligned payload", lambda m: _strict_all_reduce(m, np.float32, 3), r"payload of 12 bytes",
                 r"Pad the payload to a multiple of 16 bytes", id="all_reduce-misaligned"),
    pytest.param("integer payload", lambda m: _strict_all_reduce(m, np.int32, 16), r"\bx\b|payload",
                 r"Cast x", id="all_reduce-int32"),
    pytest.param("payload over capacity", lambda m: _strict_all_reduce(m, np.float32, CAPACITY // 4 + 4),
                 r"\bx\b|payload", r"capacity_bytes", id="all_reduce-over-capacity"),
    pytest.param("misaligned rows", lambda m: _strict_dcp(m, 1, 12), r"row of out of 24 bytes",
                 r"Pad the row of out to a multiple of 16 bytes", id="dcp_a2a-misaligned"),
    pytest.param("rows over capacity", lambda m: _strict_dcp(m, 64, 64), r"\bout\b|\bB\b|batch",
                 r"capacity_bytes", id="dcp_a2a-over-capacity"),
])
def test_strict_policy_errors_name_the_op_the_argument_and_the_fix(cpu_mesh, case, call, argument, fix):
  mesh = cpu_mesh(2)
  op = "all_reduce" if "payload" in case else "dcp_a2a"
  with fresh_communicator(capacity_bytes=CAPACITY, policy="strict"):
    with pytest.raises(b12x_jax.IneligibleError) as info:
      call(mesh)
    message = str(info.value)
    assert message.startswith(f"b12x_jax.{op}: "), message
    assert re.search(argument, _reason(message)), f"argument /{argument}/ not named in: {_reason(message)}"
    assert re.search(fix, message), f"fix /{fix}/ not given in: {message}"
    _assert_still_usable(mesh)


# -- dcp_a2a: arguments --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, out_shape, out_dtype, lse_shape, lse_dtype, kwargs, error, argument, fix", [
    (4, (2, 6, 64), jnp.bfloat16, (2, 6), jnp.float32, {}, ValueError,
     r"H=6 heads must be a multiple of the 4 devices of axis 'x'", r"pad the heads to a multiple of 4"),
    (4, (2, 2, 64), jnp.bfloat16, (2, 2), jnp.float32, {}, ValueError,
     r"H=2 heads must be a multiple of the 4 devices of axis 'x'", r"pad the heads to a multiple of 4"),
    (2, (2, 4, 64), jnp.int32, (2, 4), jnp.float32, {}, TypeError,
     r"out must be bfloat16 or float16, got int32", r"cast it"),
    (2, (2, 4, 64), jnp.bfloat16, (2, 4), jnp.float16, {}, TypeError,
     r"lse must be float32, got float16", r"cast it"),
    (2, (2, 4, 64), jnp.bfloat16, (2, 4), jnp.int32, {}, TypeError,
     r"lse must be float32, got int32", r"cast it"),
    (2, (2, 4, 8, 8), jnp.bfloat16, (2, 4), jnp.float32, {}, ValueError,
     r"out must be \[B, H, D\] \(3 dims\), got shape \(2, 4, 8, 8\)", r"reshape"),
    (2, (2, 4, 64), jnp.bfloat16, (2, 4, 1), jnp.float32, {}, ValueError,
     r"lse must have shape out.shape\[:2\] = \(2, 4\) \(\[B, H\]\), got \(2, 4, 1\)", None),
    (2, (2, 4, 64), jnp.bfloat16, (1, 4), jnp.float32, {}, ValueError,
     r"lse must have shape out.shape\[:2\] = \(2, 4\) \(\[B, H\]\), got \(1, 4\)", None),
    (2, (2, 4, 64), jnp.bfloat16, (2, 4), jnp.float32, {"lse_base": 2}, ValueError,
     r"lse_base must be 'e' \(natural log\) or '2' \(log2\), got 2", None),
    (2, (2, 4, 64), jnp.bfloat16, (2, 4), jnp.float32, {"lse_base": "E"}, ValueError,
     r"lse_base must be 'e' \(natural log\) or '2' \(log2\), got 'E'", None),
])
def test_bad_merge_arguments_are_clear_errors(cpu_mesh, n, out_shape, out_dtype, lse_shape, lse_dtype, kwargs,
                                              error, argument, fix):
  # Beyond tests/test_dcp_a2a.py's test_bad_arguments_are_clear_errors: other dtypes, ranks, N = 4.
  mesh = cpu_mesh(n)
  with pytest.raises(error) as info:
    _trace_dcp(mesh, out_shape, out_dtype, lse_shape, lse_dtype, **kwargs)
  _assert_names(str(info.value), "b12x_jax.dcp_a2a", argument, fix)
  _assert_still_usable(mesh)


@pytest.mark.parametrize("which", ["out", "lse"])
def test_a_merge_operand_that_is_not_an_array_is_a_clear_error(cpu_mesh, which):
  out, lse = np.ones((2, 4, 64), jnp.bfloat16), np.zeros((2, 4), np.float32)
  args = ([1.0], lse) if which == "out" else (out, [0.0])
  with pytest.raises(TypeError) as info:
    b12x_jax.dcp_a2a(*args, "x")
  _assert_names(str(info.value), "b12x_jax.dcp_a2a", rf"{which} must be an array, got list")
  _assert_still_usable(cpu_mesh(2))


@pytest.mark.parametrize("flag", [1, "yes"], ids=["int", "str"])
def test_a_truthy_return_lse_merges_or_is_rejected_while_tracing(cpu_mesh, flag):
  mesh = cpu_mesh(2)
  outs, lses, want, want_lse = attention_shards(np.random.default_rng(8), 2, 2, 4, 64, jnp.bfloat16)
  n, batch, heads, dim = outs.shape
  fn = jax.jit(jax.shard_map(lambda o, l: b12x_jax.dcp_a2a(o, l, "x", return_lse=flag), mesh=mesh,
                             in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
  try:
    with b12x_jax.channel(_channel(mesh)):
      got, got_lse = fn(put_sharded(mesh, outs), put_sharded(mesh, lses))
      got, got_lse = np.asarray(got), np.asarray(got_lse)
  except TypeError as e:  # rejected while tracing, clearly: fine too
    _assert_names(str(e), "b12x_jax.dcp_a2a", r"return_lse")
  else:
    assert_merge_matches(got.reshape(n, batch, heads // n, dim), got_lse.reshape(n, batch, heads // n), outs, want,
                         want_lse, "bfloat16")
  finally:
    _assert_still_usable(mesh)


# -- dcp_a2a: NaN, Inf and extreme lse -----------------------------------------------------------------------------


def test_a_nan_in_a_contributing_payload_stays_in_its_own_element(cpu_mesh):
  # Garbage in a shard that counts (finite lse) is the caller's: the merge must not spread it to other rows.
  mesh = cpu_mesh(2)
  outs, lses, want, want_lse = attention_shards(np.random.default_rng(9), 2, 3, 4, 64, jnp.bfloat16)
  outs[1, 2, 3, 5] = np.nan
  outs[0, 0, 1, 7] = np.inf
  got, got_lse = _dcp(mesh, outs, lses)
  full = np.concatenate([got[r] for r in range(2)], axis=1).astype(np.float64)  # [B, H, D]
  assert np.isnan(full[2, 3, 5]) and full[0, 1, 7] == np.inf
  bad = np.zeros(full.shape, bool)
  bad[2, 3, 5] = bad[0, 1, 7] = True
  assert np.isfinite(full[~bad]).all()
  want[2, 3, 5], want[0, 1, 7] = 0.0, 0.0
  full[bad] = 0.0
  row_scale = np.nan_to_num(np.abs(outs.astype(np.float64)), nan=0.0, posinf=0.0).max(axis=(0, -1))
  assert (np.abs(full - want).max(axis=-1) <= 2 * RTOL["bfloat16"] * row_scale + 1e-6).all()
  np.testing.assert_allclose(np.concatenate(list(got_lse), axis=1), want_lse, rtol=1e-5, atol=1e-5)
  _assert_still_usable(mesh)


@pytest.mark.parametrize("shift", [200.0, -200.0, 1000.0, -1000.0])
def test_extreme_finite_lse_values_merge_without_overflow(cpu_mesh, shift):
  # exp(lse) overflows or underflows float32 (float64 too at 1000) for every source here: the merge must anchor
  # at the max. The shift keeps lse differences exact to ~1e-4.
  mesh = cpu_mesh(2)
  outs, lses, want, want_lse = attention_shards(np.random.default_rng(10), 2, 2, 4, 64, jnp.bfloat16,
                                                empty=((0, 1, 2),))
  got, got_lse = _dcp(mesh, outs, (lses + np.float32(shift)).astype(np.float32))
  finite = np.isfinite(want_lse)
  assert_merge_matches(got, None, outs, want, want_lse, "bfloat16")
  merged_lse = np.concatenate(list(got_lse), axis=1)
  np.testing.assert_allclose(merged_lse[finite], (want_lse + np.float32(shift))[finite].astype(np.float32),
                             rtol=1e-5, atol=1e-5 * max(1.0, abs(shift)))
  _assert_still_usable(mesh)


# -- dcp_a2a at the staging capacity --------------------------------------------------------------------------------


def _staged_bytes(batch: int, heads: int, dim: int, itemsize: int, n: int, max_blocks: int) -> int:
  """What one dcp_a2a call stages per source, as the b12x window counts it
  (b12x_jax/ops/dcp_a2a.py): the B*H/N rows of this destination (a row of
  out plus its float32 lse), plus at most one row and 16 bytes of rounding
  wasted in each of the grid's cells."""
  per_row = dim * itemsize + LSE_BYTES
  return batch * heads // n * per_row + max_blocks * (per_row + PACK)


def _largest_batch(capacity: int, heads: int, dim: int, itemsize: int, n: int, max_blocks: int) -> int:
  batch = 0
  while _staged_bytes(batch + 1, heads, dim, itemsize, n, max_blocks) <= capacity:
    batch += 1
  return batch


@pytest.mark.parametrize("n, heads, dim, dtype_name, capacity, max_blocks", [
    (2, 8, 64, "bfloat16", 65536, None),   # B = 106
    (2, 8, 64, "bfloat16", 65536, 4),      # B = 123 stages exactly 65536 bytes
    (4, 8, 128, "float16", 65536, None),
    (4, 4, 128, "bfloat16", 16384, 2),
])
def test_the_largest_batch_that_fits_runs_on_b12x_and_one_more_is_an_error_under_strict(
    cpu_mesh, n, heads, dim, dtype_name, capacity, max_blocks):
  dtype = DTYPES[dtype_name]
  itemsize = np.dtype(dtype).itemsize
  blocks = max_blocks or 64  # None: the largest grid a channel can have
  batch = _largest_batch(capacity, heads, dim, itemsize, n, blocks)
  assert batch >= 1
  if max_blocks == 4:
    assert batch == 123 and _staged_bytes(batch, heads, dim, itemsize, n, blocks) == capacity
  mesh = cpu_mesh(n)
  rng = np.random.default_rng([n, heads, dim, capacity])
  # No Lamport window: the barrier protocol's staging is what fills up (ffi/dcp.h plan_dcp_call).
  with fresh_communicator(capacity_bytes=capacity, policy="strict", max_blocks=max_blocks, lamport_bytes=0):
    for _ in range(2):  # fresh inputs, both staging slots
      outs, lses, want, want_lse = attention_shards(rng, n, batch, heads, dim, dtype, kv=4,
                                                    empty=((0, 0, 0), (n - 1, batch - 1, heads - 1)),
                                                    all_empty=((batch // 2, 1),))
      got, got_lse = _dcp(mesh, outs, lses)
      assert _decision().path == "b12x", _decision()
      assert_merge_matches(got, got_lse, outs, want, want_lse, dtype_name)
    outs, lses, _, _ = attention_shards(rng, n, batch + 1, heads, dim, dtype, kv=4)
    with pytest.raises(b12x_jax.IneligibleError) as info:
      _dcp(mesh, outs, lses)
    staged = _staged_bytes(batch + 1, heads, dim, itemsize, n, blocks)
    _assert_names(str(info.value), "b12x_jax.dcp_a2a", rf"out stages {staged} bytes per source, which exceeds "
                  rf"capacity_bytes={capacity}", fix=r"Raise Communicator\(capacity_bytes=\.\.\.\) or split the batch B")
    _assert_still_usable(mesh)


@pytest.mark.parametrize("n", [2, 4])
def test_one_batch_row_above_the_capacity_falls_back_to_all_to_all_under_auto(cpu_mesh, n):
  heads, dim, capacity = 8, 64, 32768
  batch = _largest_batch(capacity, heads, dim, 2, n, 64) + 1
  mesh = cpu_mesh(n)
  with fresh_communicator(capacity_bytes=capacity, policy="auto", lamport_bytes=0):  # the barrier protocol's staging
    outs, lses, want, want_lse = attention_shards(np.random.default_rng(11), n, batch, heads, dim, jnp.bfloat16,
                                                  kv=4, empty=((0, 0, 0),))
    got, got_lse = _dcp(mesh, outs, lses)
    assert _decision().path == "all_to_all" and f"exceeds capacity_bytes={capacity}" in _decision().reason
    assert_merge_matches(got, got_lse, outs, want, want_lse, "bfloat16")
    _assert_still_usable(mesh)


# -- channel() -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [None, b"target", "targ\u00e9t", "a/b", "target\n"],
                         ids=["None", "bytes", "non-ascii", "slash", "trailing-newline"])
def test_a_bad_channel_name_is_a_clear_error_and_leaves_no_scope(cpu_mesh, bad):
  with pytest.raises(b12x_jax.ChannelError) as info:
    with b12x_jax.channel(bad):
      pass
  _assert_names(str(info.value), "b12x_jax.channel", r"channel name must be 1-64 characters",
                fix=r"use a stable semantic name")
  assert b12x_jax.current_channel() is None
  _assert_still_usable(cpu_mesh(2))


@pytest.mark.parametrize("value", ["no", 0, None])
def test_set_strict_of_a_non_bool_is_a_clear_error_and_changes_nothing(cpu_mesh, value):
  # set_strict("no") turned strict mode on
  with pytest.raises(TypeError) as info:
    b12x_jax.set_strict(value)
  _assert_names(str(info.value), "b12x_jax.set_strict", rf"enabled must be True or False, got {re.escape(repr(value))}")
  assert not b12x_jax.is_strict()
  b12x_jax.set_strict(np.True_)  # a NumPy bool is a bool, as Communicator's switches take it
  try:
    assert b12x_jax.is_strict()
  finally:
    b12x_jax.set_strict(np.False_)
  assert not b12x_jax.is_strict()
  _assert_still_usable(cpu_mesh(2))


def test_stats_of_something_that_is_not_a_device_is_a_clear_error(cpu_mesh):
  mesh = cpu_mesh(2)
  _assert_still_usable(mesh)
  with pytest.raises(TypeError) as info:
    b12x_jax.get_communicator().stats(_channel(mesh), 0)
  _assert_names(str(info.value), "Communicator.stats", r"device must be a jax.Device", fix=r"mesh.devices.flat\[0\]")


def test_a_64_character_name_is_accepted(cpu_mesh):
  name = "t" * 64
  with b12x_jax.channel(name) as got:
    assert got == name == b12x_jax.current_channel()
  _assert_still_usable(cpu_mesh(2), channel=name)


def test_an_exception_inside_a_scope_restores_the_enclosing_channel(cpu_mesh):
  with b12x_jax.channel("outer"):
    with pytest.raises(ZeroDivisionError):
      with b12x_jax.channel("inner"):
        1 / 0
    assert b12x_jax.current_channel() == "outer"
  assert b12x_jax.current_channel() is None
  _assert_still_usable(cpu_mesh(2))


# -- Communicator(...) settings ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting, value", [
    ("capacity_bytes", 0), ("capacity_bytes", -16), ("capacity_bytes", 8), ("capacity_bytes", 4096.0),
    ("capacity_bytes", "4096"), ("capacity_bytes", None), ("capacity_bytes", (1 << 30) + 16),
    ("capacity_bytes", 1 << 62),  # it was accepted: the staging size wrapped to 0 and the first call crashed
    ("timeout_s", -1), ("timeout_s", float("nan")), ("setup_timeout_s", 0), ("setup_timeout_s", -5.0),
    ("policy", "AUTO"), ("policy", "all_to_all"), ("policy", 0),
    ("max_blocks", 0), ("max_blocks", 65), ("max_blocks", -1),
    ("lamport_bytes", 8), ("lamport_bytes", 1.5), ("lamport_bytes", None),
])
def test_a_bad_communicator_setting_is_a_clear_error(cpu_mesh, setting, value):
  with pytest.raises(ValueError) as info:
    b12x_jax.Communicator(**{setting: value})
  _assert_names(str(info.value), "Communicator", rf"\b{setting} must be", fix=r"must be (one of|a|in|>)")
  assert repr(value) in str(info.value)
  _assert_still_usable(cpu_mesh(2))


def _accepted_or_rejected_clearly(mesh, setting: str, value) -> None:
  """``Communicator(setting=value)`` either raises an error naming
  Communicator and the setting, or makes a communicator that works."""
  try:
    comm = b12x_jax.Communicator(**{setting: value})
  except (TypeError, ValueError) as e:
    _assert_names(str(e), "Communicator", rf"\b{setting}\b")
  else:
    with installed(comm):
      _assert_still_usable(mesh)
  _assert_still_usable(mesh)


@pytest.mark.parametrize("setting, value, what", [
    ("timeout_s", "10", "raises a bare TypeError from '>' that names neither Communicator nor timeout_s"),
    ("setup_timeout_s", "60", "raises a bare TypeError from '>' that names neither Communicator nor setup_timeout_s"),
    ("max_blocks", "8", "raises a bare TypeError from '<=' that names neither Communicator nor max_blocks"),
    ("max_blocks", 1.5, "is accepted; preparing a channel then fails in nanobind ('incompatible function "
                        "arguments ... ChannelOptions, float')"),
], ids=["timeout_s-str", "setup_timeout_s-str", "max_blocks-str", "max_blocks-float"])
def test_a_setting_of_the_wrong_type_is_a_clear_error(cpu_mesh, setting, value, what):
  _accepted_or_rejected_clearly(cpu_mesh(2), setting, value)


def test_the_largest_capacity_is_accepted():
  assert b12x_jax.Communicator(capacity_bytes=1 << 30).capacity_bytes == 1 << 30


@pytest.mark.parametrize("setting", ["poison_outputs", "loopback"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_a_switch_that_is_not_a_bool_is_a_clear_error(cpu_mesh, setting, value):
  # poison_outputs="no" was stored as True
  with pytest.raises(TypeError) as info:
    b12x_jax.Communicator(**{setting: value})
  _assert_names(str(info.value), "Communicator", rf"\b{setting} must be True or False")
  assert repr(value) in str(info.value)
  _assert_still_usable(cpu_mesh(2))


@pytest.mark.parametrize("timeout", [float("inf"), 1e30])
def test_an_unbounded_timeout_waits_or_is_rejected(cpu_mesh, timeout):
  _accepted_or_rejected_clearly(cpu_mesh(2), "timeout_s", timeout)


# -- Communicator.prepare and set_communicator ------------------------------------------------------------------------


@pytest.mark.parametrize("axis, channels, error, argument, fix", [
    ("y", ["target"], ValueError, r"axis_name 'y' is not one of the mesh axes \('x',\)", None),
    (0, ["target"], ValueError, r"axis_name 0 is not one of the mesh axes", None),
    ("x", ["ok", "not ok"], b12x_jax.ChannelError, r"Communicator.prepare\(channels=\.\.\.\): channel name must be",
     r"use a stable semantic name"),
    ("x", [None], b12x_jax.ChannelError, r"Communicator.prepare\(channels=\.\.\.\): channel name must be", None),
])
def test_bad_prepare_arguments_are_clear_errors_and_prepare_nothing(cpu_mesh, axis, channels, error, argument, fix):
  mesh = cpu_mesh(2)
  with fresh_communicator() as comm:
    with pytest.raises(error) as info:
      comm.prepare(mesh, axis, channels=channels)
    _assert_names(str(info.value), "Communicator.prepare", argument, fix)
    assert not comm.prepared_channels()
    _assert_still_usable(mesh)


def test_prepare_with_one_channel_name_as_a_string_prepares_that_channel_or_is_an_error(cpu_mesh):
  mesh = cpu_mesh(2)
  with fresh_communicator() as comm:
    try:
      comm.prepare(mesh, "x", channels="target")
    except (TypeError, ValueError) as e:
      _assert_names(str(e), "Communicator.prepare", r"channels")
    else:
      assert sorted(comm.prepared_channels()) == ["target"], comm.prepared_channels()


def test_an_axis_wider_than_a_channel_is_a_clear_error_to_prepare_and_psum_to_call():
  # prepare wrote the ranks past 8 over the end of the group's arrays and said nothing
  result = run_worker("wide", "--devices", "9", hard_timeout=180)
  errors = result["errors"]
  assert re.fullmatch(r"ValueError: Communicator.prepare: axis 'x' has 9 devices; a channel serves at most 8 .*"
                      r"prepare an axis of at most 8 devices", errors["prepare"]), errors
  # The native layer refuses such a group and such a capacity by itself, before allocating.
  assert errors["native_ranks"] == "ChannelError: a channel group has 1 to 8 ranks, got 9", errors
  assert errors["native_capacity"] == f"ChannelError: capacity_bytes is at most {1 << 30}, got {2 << 30}", errors
  # A CPU group beyond the machine's memory (8 ranks of 16 GiB) is refused before it allocates, where
  # the memset would have brought the OOM killer; tried only on such a machine.
  if result["host_memory"] < 8 * 16 * 2**30:
    assert re.fullmatch(r"ChannelError: channel 'huge-native' on the CPU backend needs 128\.\d GiB of host memory "
                        r"for its 8 ranks \(17179869184 bytes of staging each: capacity_bytes x 8 sources x 2 slots\), "
                        r"more than the \d+\.\d GiB this process can have now \(the machine's available memory, "
                        r"within its cgroup's limit\): lower capacity_bytes", errors["native_memory"]), errors
  else:
    assert "native_memory" not in errors, errors
  assert {(op, path) for op, path, _ in result["decisions"]} == {("all_reduce", "psum"),
                                                                 ("all_reduce_residual_rmsnorm", "psum")}, result
  assert all("more than the 8 ranks" in reason for _, _, reason in result["decisions"]), result
  assert result["error"] < 1e-4, result


_CGROUP_PREPARE = """
import json, sys
from b12x_jax import _native
def prepare(limit, current, capacity, world):
  for name, value in (("memory.max", limit), ("memory.current", current)):
    with open(f"/sys/fs/cgroup/{name}", "w") as f:
      f.write(f"{value}\\n")
  options = _native.channel_options(capacity_bytes=capacity, lamport_bytes=0, timeout_s=1.0, setup_timeout_s=1.0,
                                    max_blocks=None, poison_outputs=False)
  try:
    _native.prepare("cpu", f"limited-{limit}-{current}-{capacity}", "p", list(range(world)), options)
  except Exception as e:
    return f"{type(e).__name__}: {e}"
  return "prepared"
print("RESULT " + json.dumps([prepare(*case) for case in json.loads(sys.argv[1])]))
"""


def test_a_cpu_channel_beyond_its_cgroups_memory_limit_is_refused_and_one_within_it_prepares():
  # A container's limit is what the OOM killer enforces; the machine's memory may be far above it.
  # /sys/fs/cgroup is a tmpfs in a mount namespace, with the limit and usage the case writes there.
  gib = 2**30
  cases = [(3 * gib, gib, 32 << 20, 8),     # 4 GiB for 8 ranks of 32 MiB, 2 GiB left of the limit
           (3 * gib, gib, 1 << 20, 2),      # 8 MiB fits
           ("max", gib, 1 << 20, 2),        # no limit
           (gib, 2 * gib, 1 << 20, 2)]      # usage above the limit: nothing left
  with mount_namespace("mount -t tmpfs -o size=1m tmpfs /sys/fs/cgroup", "a cgroup limit of its own") as enter:
    proc = subprocess.run([*enter, sys.executable, "-c", _CGROUP_PREPARE, json.dumps(cases)], capture_output=True,
                          text=True, timeout=60)
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  beyond, fits, unlimited, exhausted = json.loads(lines[0][len("RESULT "):])
  if _available_memory() > 2 * gib:  # else MemAvailable is the least, and the message names it
    assert re.fullmatch(r"ChannelError: channel 'limited-\d+-\d+-33554432' on the CPU backend needs 4\.0 GiB of host "
                        r"memory for its 8 ranks .* more than the 2\.0 GiB this process can have now .*: lower "
                        r"capacity_bytes", beyond), beyond
  assert fits == unlimited == "prepared", (fits, unlimited)
  assert re.fullmatch(r"ChannelError: .* needs 0\.0 GiB of host memory for its 2 ranks .* more than the 0\.0 GiB "
                      r"this process can have now .*", exhausted), exhausted


def _available_memory() -> int:
  with open("/proc/meminfo") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def test_prepare_with_a_device_list_instead_of_a_mesh_is_a_clear_error(cpu_mesh):
  with fresh_communicator() as comm:
    with pytest.raises((TypeError, ValueError)) as info:
      comm.prepare(list(jax.devices("cpu")[:2]), "x", channels=["target"])
    _assert_names(str(info.value), "Communicator.prepare", r"\bmesh\b")


def test_a_device_serves_a_channel_in_several_groups_each_with_its_own_memory(cpu_mesh):
  with fresh_communicator() as comm:
    comm.prepare(cpu_mesh(2), "x", channels=[CHANNEL])
    comm.prepare(cpu_mesh(4), "x", channels=[CHANNEL])  # device 0 again, in another partition (DESIGN C18)
    assert comm.prepared_channels() == {CHANNEL: [(0, 1), (0, 1, 2, 3)]}
    stats = [comm.stats(CHANNEL, jax.devices("cpu")[d]) for d in (0, 1)]
    assert [s["world"] for s in stats] == [2, 2]  # stats() reads the first group of a device
    _assert_still_usable(cpu_mesh(2), channel=CHANNEL)
    _assert_still_usable(cpu_mesh(4), channel=CHANNEL)


def test_a_closed_communicator_prepares_nothing_and_says_so(cpu_mesh):
  with fresh_communicator() as comm:
    comm.close()
    with pytest.raises(b12x_jax.ChannelError, match=r"this Communicator is closed; make a new one"):
      comm.prepare(cpu_mesh(2), "x", channels=[CHANNEL])
    with pytest.raises(b12x_jax.ChannelError, match=r"b12x_jax: this Communicator is closed"):
      _all_reduce(cpu_mesh(2), random_shards(np.random.default_rng(13), 2, 16, np.float32))
    assert not comm.prepared_channels()
  _assert_still_usable(cpu_mesh(2))


def test_set_communicator_rejects_a_non_communicator_and_one_that_would_orphan_channels(cpu_mesh):
  with pytest.raises(TypeError) as info:
    b12x_jax.set_communicator({"capacity_bytes": 4096})
  _assert_names(str(info.value), "set_communicator", r"expected a Communicator, got dict")
  with fresh_communicator():
    _assert_still_usable(cpu_mesh(2))
    with pytest.raises(b12x_jax.ChannelError) as info:
      b12x_jax.set_communicator(b12x_jax.Communicator())
    _assert_names(str(info.value), "set_communicator", r"still holds prepared channels \['bad-input2'\]",
                  fix=r"call its close\(\) first")
    _assert_still_usable(cpu_mesh(2))


def _hand_built_call(mesh, target: str, operands: list, results: list, **attributes):
  """The b12x custom call ``target`` on every device of ``mesh`` (axis "x"), built by hand as no op of the
  Python layer builds it: ``operands`` (per-device NumPy arrays, the same on every device) in, ``results``
  (ShapeDtypeStructs) declared, after the channel's token. Returns the jitted call."""
  from jax._src import core
  from jax._src.lib.mlir.dialects import hlo
  from jax.interpreters import mlir

  from b12x_jax.communicator import partition_key

  primitive = jax.extend.core.Primitive(f"hand_built_{target}")
  primitive.multiple_results = True
  primitive.def_abstract_eval(lambda *avals: [core.ShapedArray(r.shape, r.dtype) for r in results])
  rule = jax.ffi.ffi_lowering(target, has_side_effect=True)

  def lower(ctx, *args):
    token = core.abstract_token
    ctx = ctx.replace(avals_in=(token, *ctx.avals_in), avals_out=(token, *ctx.avals_out))
    _, *outs = rule(ctx, hlo.create_token(), *args, channel_id=_channel(mesh), group=partition_key([mesh.devices.flat]),
                    site=np.int32(7), **attributes)
    return outs

  mlir.register_lowering(primitive, lower)
  body = lambda *args: tuple(r[None] for r in primitive.bind(*(a[0] for a in args)))  # noqa: E731
  specs = (P("x"),) * len(operands)
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("x"),) * len(results), check_vma=False))
  return lambda: fn(*[jax.device_put(np.stack([a] * mesh.size), NamedSharding(mesh, P("x"))) for a in operands])


HAND_BUILT_CASES = ["all_reduce result", "fused rows", "fused result", "dcp result", "dcp lse result"]


def check_a_hand_built_call_is_refused(mesh, case: str) -> None:
  """A hand-built call of HAND_BUILT_CASES on ``mesh`` (axis "x"; its
  channel prepared here) raises the handler's message for it, and a right
  call on the channel runs after it. For the GPU twin too
  (tests/gpu/test_bad_input_gpu.py)."""
  n = mesh.shape["x"]
  b12x_jax.get_communicator().prepare(mesh, "x", channels=[_channel(mesh)])
  x, w = np.ones((2, 8), np.float32), np.ones(8, np.float32)
  out, lse = np.ones((1, 2, 8), jnp.bfloat16), np.zeros((1, 2), np.float32)
  f32, bf16 = jax.ShapeDtypeStruct, lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
  call, message = {
      "all_reduce result": (lambda: _hand_built_call(mesh, "b12x_all_reduce", [x], [f32((2, 4), np.float32)],
                                                     algorithm=np.int32(0)),
                            "all_reduce: the result must have x's shape and dtype"),
      "fused rows": (lambda: _hand_built_call(mesh, "b12x_residual_rmsnorm", [x, x, np.ones(4, np.float32)],
                                              [f32((2, 8), np.float32)] * 2, eps=np.float32(1e-6)),
                     r"x and residual must be \[..., hidden\] with weight \[hidden\]"),
      "fused result": (lambda: _hand_built_call(mesh, "b12x_residual_rmsnorm", [x, x, w],
                                                [f32((2, 8), np.float32), f32((1, 8), np.float32)], eps=np.float32(1e-6)),
                       "both results must have x's shape and dtype"),
      "dcp result": (lambda: _hand_built_call(mesh, "b12x_dcp_a2a", [out, lse], [bf16((1, 1, 4))], base2=False,
                                              return_lse=False),
                     r"the merged out must be \[B, H/N, D\]"),
      "dcp lse result": (lambda: _hand_built_call(mesh, "b12x_dcp_a2a", [out, lse],
                                                  [bf16((1, 2 // n, 8)), f32((3,), np.float32)], base2=False,
                                                  return_lse=True),
                         r"the merged lse must be float32 \[B, H/N\]"),
  }[case]
  with pytest.raises(Exception, match=message):
    jax.block_until_ready(call()())
  _assert_still_usable(mesh)


@pytest.mark.parametrize("case", HAND_BUILT_CASES)
def test_a_hand_built_call_whose_shapes_disagree_is_refused_by_the_handler(cpu_mesh, case):
  # Only a custom call built by hand reaches the handlers so: they refuse it rather than write past a result or
  # normalise rows of another width.
  check_a_hand_built_call_is_refused(cpu_mesh(2), case)
