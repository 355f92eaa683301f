"""all_reduce_residual_rmsnorm on the CPU backend: values against float64,
the fused and unfused paths, errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import b12x_jax
from conftest import run_worker
from helpers import (DTYPES, assert_residual_rmsnorm_matches, check_residual_rmsnorm_case, fresh_communicator,
                     residual_rmsnorm_fn, residual_rmsnorm_inputs)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("rows, hidden", [(1, 4096), (8, 1024), (64, 256), (3, 8192)])
def test_fused_op_matches_float64_on_every_rank(cpu_mesh, n, dtype_name, rows, hidden):
  with fresh_communicator(poison_outputs=True) as comm, b12x_jax.channel("fused"):
    check_residual_rmsnorm_case(cpu_mesh(n), np.random.default_rng(rows * hidden + n), rows, hidden, dtype_name)
    assert comm.decisions[-1].path == "b12x", comm.decisions[-1]


@pytest.mark.parametrize("n", [3, 5, 6, 7, 8])
def test_fused_op_matches_float64_on_three_and_five_to_eight_ranks(n):
  # Worlds whose sum leaves sources of the loops to kMaxRanks unused, and the largest, on emulated CPU
  # devices in a worker (this process has 4).
  result = run_worker("fused", "--devices", str(n), "--seed", str(n), hard_timeout=300)
  assert result == {"checked": len(DTYPES) * 5, "paths": ["b12x"]}, result


def test_rows_outside_the_lamport_window_take_the_unfused_path_with_the_same_result(cpu_mesh):
  rng = np.random.default_rng(5)
  with fresh_communicator(poison_outputs=True, lamport_bytes=64 * 1024) as comm, b12x_jax.channel("unfused"):
    check_residual_rmsnorm_case(cpu_mesh(2), rng, 64, 4096, "bfloat16")  # 512 KiB: 8 KiB rows in 1 KiB cells
    decision = comm.decisions[-2]
    assert decision.op == "all_reduce_residual_rmsnorm" and decision.path == "unfused", decision
    assert "Lamport cells" in decision.reason and comm.decisions[-1].path == "b12x"  # the all_reduce inside
  with fresh_communicator(lamport_bytes=0) as comm, b12x_jax.channel("unfused"):
    check_residual_rmsnorm_case(cpu_mesh(2), rng, 4, 512, "float32")
    assert comm.decisions[-2].path == "unfused" and "lamport_bytes=0" in comm.decisions[-2].reason


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_the_unfused_path_rounds_the_new_residual_once_as_the_fused_op_does(cpu_mesh, dtype_name):
  # The same inputs on both paths: the sum over ranks plus the residual, rounded once to 16 bits, is the same
  # bits whichever path a call took (a sum rounded to 16 bits before the add differs in about a fifth).
  mesh = cpu_mesh(2)
  shards, residual, weight = residual_rmsnorm_inputs(np.random.default_rng(11), 2, 4, 512, dtype_name)
  results = {}
  for lamport_bytes, path in [(1 << 20, "b12x"), (0, "unfused")]:
    with fresh_communicator(poison_outputs=True, lamport_bytes=lamport_bytes) as comm, b12x_jax.channel("paths"):
      normed, new_residual = residual_rmsnorm_fn(mesh, 1e-6)(jax.device_put(shards, NamedSharding(mesh, P("x"))),
                                                             residual, weight)
      assert [d.path for d in comm.decisions if d.op == "all_reduce_residual_rmsnorm"] == [path], comm.decisions
    assert_residual_rmsnorm_matches(np.asarray(normed), np.asarray(new_residual), shards, residual, weight, 1e-6,
                                    dtype_name)
    results[path] = np.asarray(new_residual)
  assert np.array_equal(results["b12x"].view(np.uint16), results["unfused"].view(np.uint16))


@pytest.mark.parametrize("rows, path", [(32, "b12x"), (64, "unfused")])
def test_the_lamport_window_is_clamped_to_the_capacity_in_one_place(cpu_mesh, rows, path):
  # 256 KiB of capacity under the default 1 MiB window: the native layout
  # clamps the window, and the choice of the fused op reads that layout
  # (rows of 4096 bf16 are 8 KiB: 32 fit, 64 do not).
  with fresh_communicator(poison_outputs=True, capacity_bytes=256 * 1024) as comm, b12x_jax.channel("clamped"):
    check_residual_rmsnorm_case(cpu_mesh(2), np.random.default_rng(rows), rows, 4096, "bfloat16")
    fused = [d for d in comm.decisions if d.op == "all_reduce_residual_rmsnorm"]
    assert [d.path for d in fused] == [path] if path == "b12x" else fused[-1].path == "unfused", comm.decisions


def test_interleaves_with_all_reduce_on_one_channel(cpu_mesh):
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(7)

  def body(x, residual, weight, y):
    normed, new_residual = b12x_jax.all_reduce_residual_rmsnorm(x[0], residual, weight, "x")
    total = b12x_jax.all_reduce(y, "x")
    normed2, _ = b12x_jax.all_reduce_residual_rmsnorm(x[0], new_residual, weight, "x")
    return normed[None], total, normed2[None]

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P(), P("x")),
                             out_specs=(P("x"), P("x"), P("x")), check_vma=False))
  x = rng.standard_normal((2, 4, 512)).astype(np.float32)
  residual = rng.standard_normal((4, 512)).astype(np.float32)
  weight = rng.standard_normal(512).astype(np.float32)
  y = rng.standard_normal((2, 64)).astype(np.float32)
  with b12x_jax.channel("mixed"):
    normed, total, normed2 = fn(jax.device_put(x, NamedSharding(mesh, P("x"))), residual, weight,
                                jax.device_put(y.reshape(-1), NamedSharding(mesh, P("x"))))
  s = x.astype(np.float64).sum(0) + residual
  np.testing.assert_allclose(np.asarray(total).reshape(2, -1)[0], y.sum(0), rtol=1e-6)
  ref = s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-6) * weight
  np.testing.assert_allclose(np.asarray(normed)[0], ref, rtol=1e-4, atol=1e-5)
  s2 = x.astype(np.float64).sum(0) + s
  ref2 = s2 / np.sqrt((s2 * s2).mean(-1, keepdims=True) + 1e-6) * weight
  np.testing.assert_allclose(np.asarray(normed2)[1], ref2, rtol=1e-4, atol=1e-5)
  assert b12x_jax.get_communicator().stats("mixed", mesh.devices[0])["epoch"] == 3


def test_one_device_axis_adds_and_normalises_locally(cpu_mesh):
  mesh = cpu_mesh(1)
  x = np.random.default_rng(1).standard_normal((1, 2, 64)).astype(np.float32)
  residual, weight = np.ones((2, 64), np.float32), np.full(64, 2.0, np.float32)
  normed, new_residual = residual_rmsnorm_fn(mesh)(jax.device_put(x, NamedSharding(mesh, P("x"))), residual, weight)
  s = x[0].astype(np.float64) + 1
  np.testing.assert_allclose(np.asarray(new_residual)[0], s, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(normed)[0], 2 * s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-6),
                             rtol=1e-5)


@pytest.mark.parametrize("x_shape, res_shape, w_shape, dtype, match", [
    ((4, 64), (4, 32), (64,), jnp.float32, r"residual must match x"),
    ((4, 64), (4, 64), (32,), jnp.float32, r"weight must be \[hidden\]"),
    ((4, 64), (4, 64), (64,), jnp.int32, r"x must be one of"),
    ((), (), (1,), jnp.float32, r"x must be \[\.\.\., hidden\]"),
])
def test_bad_arguments_are_clear_errors(cpu_mesh, x_shape, res_shape, w_shape, dtype, match):
  mesh = cpu_mesh(2)

  def body(x):
    return b12x_jax.all_reduce_residual_rmsnorm(jnp.zeros(x_shape, dtype), jnp.zeros(res_shape, dtype),
                                                jnp.zeros(w_shape, dtype), "x")[0]
  with pytest.raises((ValueError, TypeError), match=r"b12x_jax\.all_reduce_residual_rmsnorm: " + match):
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))(jnp.zeros(2))


def test_rows_of_no_element_give_empty_results_as_psum_and_jnp_do(cpu_mesh):
  # It raised "x must be [..., hidden] with at least one element" where psum and jnp give empty arrays.
  mesh = cpu_mesh(2)
  for shape in ((0, 64), (2, 0, 64), (3, 0)):
    def body(x):
      return b12x_jax.all_reduce_residual_rmsnorm(x, x, jnp.ones(x.shape[-1:]), "x")
    normed, new_residual = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))(jnp.ones(shape))
    assert normed.shape == new_residual.shape == shape and normed.dtype == jnp.float32, (shape, normed)


def test_weight_of_another_dtype_and_bad_eps_are_clear_errors(cpu_mesh):
  mesh = cpu_mesh(2)

  def call(weight_dtype, eps):
    def body(x):
      return b12x_jax.all_reduce_residual_rmsnorm(x, x, jnp.ones(x.shape[-1:], weight_dtype), "x", eps=eps)[0]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))(jnp.ones((2, 16)))
  with pytest.raises(TypeError, match=r"all_reduce_residual_rmsnorm: weight must have x's dtype float32.*astype"):
    call(jnp.bfloat16, 1e-6)
  # inf gave zeros without an error; 1e-46 and 1e39, 0 and inf in the float32 math, and 1e-40, a subnormal
  # XLA flushes to 0, gave NaN where a row is zero
  for eps in (0.0, -1e-6, float("inf"), float("nan"), 1e-46, 1e-40, 1e39):
    with pytest.raises(ValueError, match=r"all_reduce_residual_rmsnorm: eps must be a normal float32 > 0 .*"
                                         r"pass one in \[1.18e-38, 3.4e\+38\]"):
      call(jnp.float32, eps)
  normed_of = jax.jit(jax.shard_map(  # the smallest eps taken keeps a zero row finite
      lambda x: b12x_jax.all_reduce_residual_rmsnorm(x, x, jnp.ones(x.shape[-1:]), "x", eps=1.2e-38)[0],
      mesh=mesh, in_specs=P(), out_specs=P()))
  np.testing.assert_array_equal(np.asarray(normed_of(jnp.zeros((2, 16)))), np.zeros((2, 16), np.float32))
  for eps in ("1e-6", None, True, 1e-6j, np.array([1e-6])):
    with pytest.raises(TypeError, match=r"all_reduce_residual_rmsnorm: eps must be a real number.*Python float"):
      call(jnp.float32, eps)
  # A NumPy, ml_dtypes or JAX scalar from a config is a number: the same result as its float.
  for eps in (np.float32(1e-3), jnp.float32(1e-3), np.array(1e-3), jnp.bfloat16(1e-3), np.int64(1), jnp.int32(1)):
    np.testing.assert_array_equal(np.asarray(call(jnp.float32, eps)), np.asarray(call(jnp.float32, float(eps))))
  traced = jax.jit(jax.shard_map(  # eps is an attribute of the call: it was an anonymous TracerBoolConversionError
      lambda x, eps: b12x_jax.all_reduce_residual_rmsnorm(x, x, jnp.ones(x.shape[-1:]), "x", eps=eps)[0],
      mesh=mesh, in_specs=(P(), P()), out_specs=P()))
  with pytest.raises(TypeError, match=r"all_reduce_residual_rmsnorm: eps must be a constant .* got a traced "
                                      r"value .* pass a Python float"):
    traced(jnp.ones((2, 16)), jnp.float32(1e-6))


def test_a_peer_that_never_joins_a_fused_call_times_out_with_names():
  result = run_worker("timeout", "--platform", "cpu", "--op", "residual_rmsnorm", "--timeout", "1.0", hard_timeout=120)
  assert len(result["messages"]) == 2 and result["nan_outputs"] == [], result
  for message in result["messages"]:
    assert re.search(r"channel 'lonely' rank 0 timed out after 1 s at epoch 1 waiting for rank 1", message), message
  assert result["seconds"] < 30
