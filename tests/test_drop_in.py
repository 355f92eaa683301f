"""all_reduce where jax.lax.psum stood (issue 15): under jax.grad, jvp,
value_and_grad and checkpoint, under vmap (a batched call, and a vmap axis
name), over a tuple of axes, with axis_index_groups, on pytrees. Each is
compared with psum on the same fresh random inputs; where b12x cannot run a
case the decision says why (psum under "auto")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fresh_communicator
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import b12x_jax


def _both(mesh, body, x, in_specs=P("x"), out_specs=P(), check_vma=True):
  """body(reduce) under b12x and under psum, jitted over ``mesh``, on x."""
  outs = []
  for reduce in (b12x_jax.all_reduce, jax.lax.psum):
    fn = jax.jit(jax.shard_map(lambda v: body(reduce, v), mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                               check_vma=check_vma))
    outs.append(jax.tree.map(np.asarray, fn(x)))
  return outs


def _sharded(mesh, x, spec=P("x")):
  return jax.device_put(x, NamedSharding(mesh, spec))


@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_jvp_and_value_and_grad_match_psum(cpu_mesh, check_vma):
  mesh = cpu_mesh(4)
  rng = np.random.default_rng(0)
  x = _sharded(mesh, rng.standard_normal(4 * 64).astype(np.float32))
  t = _sharded(mesh, rng.standard_normal(4 * 64).astype(np.float32))

  def loss(reduce, v):
    return jnp.sum(jnp.sin(reduce(v * v, "x")) * v)

  with fresh_communicator() as comm, b12x_jax.channel("ad"):
    for make in (lambda r: lambda v: jax.grad(lambda u: loss(r, u))(v),
                 lambda r: lambda v: jax.value_and_grad(lambda u: loss(r, u))(v)[1],
                 lambda r: lambda v: jax.grad(jax.checkpoint(lambda u: loss(r, u)))(v)):
      ours, theirs = _both(mesh, lambda r, v: make(r)(v), x, out_specs=P("x"), check_vma=check_vma)
      np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    assert {d.path for d in comm.decisions if d.channel == "ad"} == {"b12x"}
    jvps = []
    for reduce in (b12x_jax.all_reduce, jax.lax.psum):
      fn = jax.jit(jax.shard_map(lambda v, w: jax.jvp(lambda u: reduce(u * u, "x"), (v,), (w,)), mesh=mesh,
                                 in_specs=(P("x"), P("x")), out_specs=(P(), P()), check_vma=check_vma))
      jvps.append([np.asarray(a) for a in fn(x, t)])
    np.testing.assert_allclose(jvps[0], jvps[1], rtol=1e-5, atol=1e-5)


def test_vmap_inside_shard_map_is_one_batched_call(cpu_mesh):
  mesh = cpu_mesh(2)
  x = _sharded(mesh, np.random.default_rng(1).standard_normal((2 * 8, 32)).astype(np.float32))
  with fresh_communicator(), b12x_jax.channel("batched"):
    ours, theirs = _both(mesh, lambda r, v: jax.vmap(lambda row: r(row, "x"))(v), x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    fn = jax.jit(jax.shard_map(jax.vmap(lambda row: b12x_jax.all_reduce(row, "x")), mesh=mesh, in_specs=P("x"),
                               out_specs=P()))
    calls = [ln for ln in fn.lower(x).as_text().splitlines() if "custom_call @b12x_all_reduce" in ln]
    assert len(calls) == 1 and "tensor<8x32xf32>" in calls[0], calls  # one call of the stacked payload


def test_a_vmap_axis_name_takes_psum_and_says_why(cpu_mesh):
  mesh = cpu_mesh(2)
  x = _sharded(mesh, np.random.default_rng(2).standard_normal((2 * 4, 16)).astype(np.float32))
  with fresh_communicator() as comm, b12x_jax.channel("vmapped"):
    # check_vma=False: jax 0.11.2's own psum over a vmap axis inside shard_map fails its type check.
    ours, theirs = _both(mesh, lambda r, v: jax.vmap(lambda row: r(row, "v"), axis_name="v")(v), x,
                         out_specs=P("x"), check_vma=False)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert "not a jax.shard_map mesh axis" in comm.decisions[-1].reason
  with fresh_communicator(policy="strict"), b12x_jax.channel("vmapped"), pytest.raises(
      b12x_jax.IneligibleError, match=r"b12x_jax.all_reduce: axis 'v' is not a jax.shard_map mesh axis"):
    _both(mesh, lambda r, v: jax.vmap(lambda row: r(row, "v"), axis_name="v")(v), x, out_specs=P("x"),
          check_vma=False)


def test_a_tuple_of_axes_and_axis_index_groups_match_psum(cpu_mesh):
  mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices("cpu")[:4])
  x = _sharded(mesh, np.random.default_rng(3).standard_normal((2 * 4, 2 * 8)).astype(np.float32), P("a", "b"))
  with fresh_communicator() as comm, b12x_jax.channel("axes"):
    for body in (lambda r, v: r(v, ("a", "b")), lambda r, v: r(v, ("b",)), lambda r, v: r(v, "a"),
                 lambda r, v: r(v, "b", axis_index_groups=[[0, 1]])):
      ours, theirs = _both(mesh, body, x, in_specs=P("a", "b"), out_specs=P("a", "b"), check_vma=False)
      np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    paths = [d.path for d in comm.decisions if d.channel == "axes"]
    assert paths == ["psum", "b12x", "b12x", "psum"], comm.decisions


def test_a_pytree_sums_leaf_by_leaf(cpu_mesh):
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(4)
  x = _sharded(mesh, rng.standard_normal(2 * 64).astype(np.float32))
  with fresh_communicator(), b12x_jax.channel("tree"):
    ours, theirs = _both(mesh, lambda r, v: r({"a": v, "b": (v * 2, v.astype(jnp.bfloat16))}, "x"), x,
                         out_specs=P())
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2)


def test_one_channel_serves_any_device_group_in_one_process(cpu_mesh):
  """DESIGN C18: a 2-device mesh, a 4-device mesh, a reversed mesh and both
  axes of a 2-D mesh in one function, all on channel "default", each group
  with memory of its own; values against float64."""
  rng = np.random.default_rng(5)
  cpus = jax.devices("cpu")
  with fresh_communicator(poison_outputs=True):
    for mesh in (cpu_mesh(2), cpu_mesh(4), jax.make_mesh((2,), ("x",), devices=cpus[1::-1])):
      n = mesh.devices.size
      shards = rng.standard_normal((n, 64)).astype(np.float32)
      fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
      np.testing.assert_allclose(np.asarray(fn(_sharded(mesh, shards.reshape(-1)))),
                                 shards.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=cpus[:4])
    shards = rng.standard_normal((2, 2, 64)).astype(np.float32)
    fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(b12x_jax.all_reduce(v, "a"), "b"), mesh=mesh,
                               in_specs=P("a", "b"), out_specs=P()))
    got = fn(_sharded(mesh, shards.reshape(2, 2 * 64), P("a", "b")))  # device (i, j) holds shards[i, j]
    np.testing.assert_allclose(np.asarray(got).reshape(-1), shards.astype(np.float64).sum((0, 1)), rtol=1e-5,
                               atol=1e-5)
    assert len(b12x_jax.get_communicator().prepared_channels()["default"]) == 1 + 1 + 1 + 2 + 2


def test_the_fused_op_and_dcp_a2a_differentiate_like_their_fallback_formulas(cpu_mesh):
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(6)
  x = _sharded(mesh, rng.standard_normal((2 * 4, 64)).astype(np.float32))
  res = jnp.asarray(rng.standard_normal((4, 64)).astype(np.float32))
  w = jnp.asarray((1 + 0.1 * rng.standard_normal(64)).astype(np.float32))

  def fused_loss(fused, v):
    normed, new_residual = fused(v)
    return jnp.sum(normed * jnp.cos(new_residual))

  ours = lambda v: b12x_jax.all_reduce_residual_rmsnorm(v, res, w, "x")  # noqa: E731
  def theirs(v):
    total = (jax.lax.psum(v, "x") + res).astype(v.dtype)
    r = total.astype(jnp.float32)
    return (r * jax.lax.rsqrt(jnp.mean(r * r, -1, keepdims=True) + 1e-6) * w).astype(v.dtype), total
  grads = []
  with fresh_communicator() as comm, b12x_jax.channel("fused-ad"):
    for fused in (ours, theirs):
      fn = jax.jit(jax.shard_map(jax.grad(lambda v: fused_loss(fused, v)), mesh=mesh, in_specs=P("x"),
                                 out_specs=P("x"), check_vma=False))
      grads.append(np.asarray(fn(x)))
    assert any(d.op == "all_reduce_residual_rmsnorm" and d.path == "b12x" for d in comm.decisions)
  np.testing.assert_allclose(grads[0], grads[1], rtol=1e-4, atol=1e-5)

  out = _sharded(mesh, rng.standard_normal((2 * 2, 8, 64)).astype(np.float32).astype(jnp.bfloat16))
  lse = _sharded(mesh, rng.standard_normal((2 * 2, 8)).astype(np.float32))

  def merge_loss(o, l, use_b12x):
    if use_b12x:
      merged = b12x_jax.dcp_a2a(o, l, "x")
    else:
      from b12x_jax.ops.dcp_a2a import _all_to_all_path
      merged = _all_to_all_path(o, l, axis_name="x", base2=False, return_lse=False)[0]
    return jnp.sum(merged.astype(jnp.float32) ** 2)

  dcp_grads = []
  with fresh_communicator() as comm, b12x_jax.channel("dcp-ad"):
    for use_b12x in (True, False):
      fn = jax.jit(jax.shard_map(jax.grad(lambda o, l: merge_loss(o, l, use_b12x), argnums=1), mesh=mesh,
                                 in_specs=(P("x"), P("x")), out_specs=P("x"), check_vma=False))
      dcp_grads.append(np.asarray(fn(out, lse)))
    assert any(d.op == "dcp_a2a" and d.path == "b12x" for d in comm.decisions)
  np.testing.assert_allclose(dcp_grads[0], dcp_grads[1], rtol=1e-3, atol=1e-4)
