"""all_reduce where jax.lax.psum stood (a drop-in for psum): under jax.grad, jvp,
value_and_grad and checkpoint, under vmap (a batched call, and a vmap axis
name), over a tuple of axes, with axis_index_groups, on pytrees. Each is
compared with psum on the same fresh random inputs; where b12x cannot run a
case the decision says why (psum under "auto"). dcp_a2a and the fused op
under vmap (one call of the folded batches), against float64."""

from __future__ import annotations

import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (assert_merge_matches, assert_residual_rmsnorm_matches, assert_sum_matches, attention_shards,
                     fresh_communicator, residual_rmsnorm_fn, residual_rmsnorm_inputs)
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


def test_a_vmap_axis_named_like_the_mesh_axis_means_the_vmap_axis_as_for_psum(cpu_mesh):
  # Inside the vmap "x" names the vmap axis: psum sums the rows of each rank, not the ranks.
  mesh = cpu_mesh(2)
  x = _sharded(mesh, np.random.default_rng(21).standard_normal((2 * 4, 16)).astype(np.float32))
  body = lambda r, v: jax.vmap(lambda row: r(row, "x"), axis_name="x")(v)  # noqa: E731
  for inner in (lambda f: f, jax.jit):  # also where the vmapped function is a jitted one, traced under the vmap
    with fresh_communicator() as comm, b12x_jax.channel("shadowed"):
      ours, theirs = _both(mesh, lambda r, v: body(lambda a, n: inner(lambda b: r(b, n))(a), v), x, out_specs=P("x"),
                           check_vma=False)
      np.testing.assert_array_equal(ours, theirs)
      assert "names a jax.vmap axis" in comm.decisions[-1].reason, comm.decisions
  want = np.asarray(x).reshape(2, 4, 16).astype(np.float64).sum(1, keepdims=True)
  np.testing.assert_allclose(ours.reshape(2, 4, 16), np.broadcast_to(want, (2, 4, 16)), rtol=1e-5, atol=1e-5)


def test_a_call_batched_over_a_vmap_axis_of_its_own_axis_name_is_an_error(cpu_mesh):
  # A function traced inside the shard_map, then vmapped over an axis of the same
  # name: no check saw the vmap at trace time, the batching rule refuses.
  mesh = cpu_mesh(2)
  x = _sharded(mesh, np.random.default_rng(22).standard_normal((2 * 4, 16)).astype(np.float32))

  def body(v):
    traced = jax.make_jaxpr(lambda row: b12x_jax.all_reduce(row, "x"))(v[0])
    return jax.vmap(jax.extend.core.jaxpr_as_fun(traced), axis_name="x")(v)[0]

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  with fresh_communicator(), b12x_jax.channel("shadowed-late"), pytest.raises(
      ValueError, match=r"b12x_jax.all_reduce: axis 'x' names both a jax.vmap axis and the mesh axis"):
    fn.lower(x)


def test_a_tuple_of_axes_and_axis_index_groups_match_psum(cpu_mesh):
  mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices("cpu")[:4])
  x = _sharded(mesh, np.random.default_rng(3).standard_normal((2 * 4, 2 * 8)).astype(np.float32), P("a", "b"))
  with fresh_communicator() as comm, b12x_jax.channel("axes"):
    for body in (lambda r, v: r(v, ("a", "b")), lambda r, v: r(v, ("b",)), lambda r, v: r(v, "a"),
                 lambda r, v: r(v, "b", axis_index_groups=[[1, 0]]),  # one group of the whole axis: b12x's
                 lambda r, v: r(v, "b", axis_index_groups=[[0], [1]])):
      ours, theirs = _both(mesh, body, x, in_specs=P("a", "b"), out_specs=P("a", "b"), check_vma=False)
      np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    paths = [d.path for d in comm.decisions if d.channel == "axes"]
    assert paths == ["psum", "b12x", "b12x", "b12x", "psum"], comm.decisions


def test_a_pytree_matches_psum(cpu_mesh):
  mesh = cpu_mesh(2)
  shards = np.random.default_rng(4).standard_normal((2, 64)).astype(np.float32)
  with fresh_communicator(poison_outputs=True) as comm, b12x_jax.channel("tree"):
    ours, theirs = _both(mesh, lambda r, v: r({"a": v, "b": (v * 2, v.astype(jnp.bfloat16))}, "x"),
                         _sharded(mesh, shards.reshape(-1)), out_specs=P())
    assert [d.path for d in comm.decisions if d.channel == "tree"] == ["b12x", "b12x"], comm.decisions  # a pack each
  # Each leaf against float64, as a call of its own would give it; psum's within its roundings.
  for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
  for leaf, leaf_shards in zip(jax.tree.leaves(ours), (shards, 2 * shards, shards.astype(jnp.bfloat16))):
    assert_sum_matches(np.asarray(leaf)[None], leaf_shards, np.dtype(leaf.dtype).name)


# Leaves of a pytree: (shape, dtype) per rank. Under a Lamport window of 4096 bytes the float32
# leaves but the last are one call of 4 + 35 + 32 + 64 floats (540 bytes, padded to 544), the
# bfloat16 ones one call of 9 + 16 + 33 (116 bytes, padded to 128), the last float32 leaf (8192
# bytes) a call of its own, the int32 leaf psum.
PYTREE = {"a": ((4,), np.float32), "b": ((5, 7), np.float32), "c": ((9,), jnp.bfloat16), "d": ((4, 8), np.float32),
          "e": ((16,), jnp.bfloat16), "f": ((64,), np.float32), "g": ((33,), jnp.bfloat16), "h": ((8,), np.int32),
          "i": ((2048,), np.float32)}
PACKED_CALLS = ("tensor<136xf32>", "tensor<64xbf16>", "tensor<2048xf32>")


def _pytree_shards(rng, n: int) -> dict:
  return {k: (rng.integers(-9, 9, (n, *shape)) if np.dtype(dtype).kind == "i" else
              rng.standard_normal((n, *shape))).astype(dtype) for k, (shape, dtype) in PYTREE.items()}


@pytest.mark.parametrize("x", [1, 2.5, np.float32(2.0), (3, np.arange(3)), {"a": np.int8(3)}])
def test_constants_sum_while_tracing_into_what_psum_gives(cpu_mesh, x):
  # psum(1, axis) is the axis size as a static int (a shape, a loop bound);
  # all_reduce gave a traced array that no shape could take. psum decides
  # leaf by leaf, so a constant beside a traced leaf stays static too.
  mesh = cpu_mesh(2)
  def body(y):
    ours, theirs = jax.tree.leaves(b12x_jax.all_reduce(x, "x")), jax.tree.leaves(jax.lax.psum(x, "x"))
    assert [type(a) for a in ours] == [type(b) for b in theirs], (ours, theirs)
    for a, b in zip(ours, theirs):
      np.testing.assert_array_equal(a, b)
    size, total = b12x_jax.all_reduce((1, y.sum()), "x")
    return y.reshape(size, -1).sum(0) + 0 * total
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  with b12x_jax.channel("constants"):
    got = fn(jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("x"))))
  np.testing.assert_array_equal(np.asarray(got), [2, 4, 10, 12])


@pytest.mark.parametrize("check_vma", [True, False])
def test_weak_types_and_so_promoted_dtypes_match_psum(cpu_mesh, check_vma):
  # A pack made a weak leaf strong, and a lone call kept a weak type that
  # psum drops without check_vma: bfloat16 + the sum promoted differently.
  mesh = cpu_mesh(2)
  seen = {}
  def body(x, scale):
    weak = jnp.broadcast_to(scale, (4,))  # weakly typed float32[4]
    for f in (jax.lax.psum, b12x_jax.all_reduce):
      packed, alone = f((weak, jnp.full(4, 3.0, jnp.float32)), "x")[0], f(weak, "x")
      seen[f.__name__] = [(jax.typeof(r).weak_type, (r + jnp.ones(4, jnp.bfloat16)).dtype) for r in (packed, alone)]
    return x
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"), check_vma=check_vma))
  with b12x_jax.channel("weak"):
    fn(_sharded(mesh, np.arange(8, dtype=np.float32)), 2.0)
  assert seen["all_reduce"] == seen["psum"], seen
  assert [d.path for d in b12x_jax.get_communicator().decisions[-2:]] == ["b12x", "b12x"]


def test_a_pytree_of_small_leaves_is_one_packed_call_per_dtype(cpu_mesh):
  n = 4
  mesh = cpu_mesh(n)
  rng = np.random.default_rng(15)
  every_rank = lambda tree: jax.tree.map(lambda r: r[None], tree)  # noqa: E731
  packed = jax.jit(jax.shard_map(lambda t: every_rank(b12x_jax.all_reduce(jax.tree.map(lambda v: v[0], t), "x")),
                                 mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  per_leaf = jax.jit(jax.shard_map(
      lambda t: every_rank({k: b12x_jax.all_reduce(v[0], "x") for k, v in t.items()}), mesh=mesh, in_specs=P("x"),
      out_specs=P("x")))
  with fresh_communicator(lamport_bytes=4096, poison_outputs=True) as comm, b12x_jax.channel("packed"):
    for _ in range(2):  # fresh inputs, two Lamport buffers
      shards = _pytree_shards(rng, n)
      args = {k: _sharded(mesh, v) for k, v in shards.items()}
      got = jax.tree.map(np.asarray, packed(args))
      alone = jax.tree.map(np.asarray, per_leaf(args))
      for k, v in shards.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        if np.dtype(v.dtype).kind == "i":
          np.testing.assert_array_equal(got[k], np.broadcast_to(v.astype(np.int64).sum(0), v.shape))
          continue
        assert_sum_matches(got[k].reshape(n, -1), v.reshape(n, -1), np.dtype(v.dtype).name)
        if v[0].nbytes % 16 == 0:  # b12x alone too: the same bits
          np.testing.assert_array_equal(got[k].view(np.uint8), alone[k].view(np.uint8), err_msg=k)
    packs = [d for d in comm.decisions if "packed into one call" in d.reason]
    assert {"; ".join(d.reason.split("; ")[:2]) for d in packs} == {
        "inside the b12x window; 4 leaves packed into one call of 544 bytes",
        "inside the b12x window; 3 leaves packed into one call of 128 bytes"}, comm.decisions
    assert {d.path for d in packs} == {"b12x"}
    calls = _b12x_calls(packed, args, target="b12x_all_reduce")
    payloads = [re.search(r": \(!stablehlo.token, (tensor<\w+>)\)", ln).group(1) for ln in calls]
    assert sorted(payloads) == sorted(PACKED_CALLS), calls


def test_packs_fill_the_window_in_leaf_order_and_pad_leaves_strict_would_refuse_alone(cpu_mesh):
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(17)
  shards = [rng.standard_normal((2, 375)).astype(np.float32) for _ in range(4)]  # 1500 bytes each
  fn = jax.jit(jax.shard_map(lambda *t: [r[None] for r in b12x_jax.all_reduce([v[0] for v in t], "x")],
                             mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  with fresh_communicator(lamport_bytes=4096, policy="strict"), b12x_jax.channel("packs"):
    args = [_sharded(mesh, a) for a in shards]
    for got, a in zip(fn(*args), shards):
      np.testing.assert_allclose(np.asarray(got), np.broadcast_to(a.astype(np.float64).sum(0), a.shape), rtol=1e-6,
                                 atol=1e-6)
    payloads = [re.search(r": \(!stablehlo.token, (tensor<\w+>)\)", ln).group(1)
                for ln in _b12x_calls(fn, *args, target="b12x_all_reduce")]
    assert payloads == ["tensor<752xf32>"] * 2, payloads  # leaves 0, 1 and 2, 3: 3000 bytes padded to 3008 each
  with fresh_communicator(policy="strict"), b12x_jax.channel("packs"), pytest.raises(
      b12x_jax.IneligibleError, match="payload of 1500 bytes is not a multiple of 16 bytes"):
    jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v[0], "x"), mesh=mesh, in_specs=P("x"),
                          out_specs=P())).lower(args[0])


def test_packs_fit_capacity_bytes_too_where_it_is_below_the_lamport_window(cpu_mesh):
  mesh = cpu_mesh(2)
  tree = {k: _sharded(mesh, np.random.default_rng(23 + j).standard_normal((2, 200)).astype(np.float32))
          for j, k in enumerate("ab")}  # 800 bytes a leaf, 1600 together
  with fresh_communicator(capacity_bytes=1024, lamport_bytes=4096, policy="strict") as comm, \
       b12x_jax.channel("small-capacity"):
    got = jax.jit(jax.shard_map(lambda t: b12x_jax.all_reduce(t, "x"), mesh=mesh, in_specs=P("x"),
                                out_specs=P()))(tree)
    assert [d.path for d in comm.decisions] == ["b12x", "b12x"], comm.decisions  # a call each, none refused
  for k, leaf in tree.items():
    np.testing.assert_allclose(np.asarray(got[k])[0], np.asarray(leaf, np.float64).sum(0), rtol=1e-5, atol=1e-5)


def test_grad_and_vmap_of_a_packed_pytree_match_psum(cpu_mesh):
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(16)
  x = _sharded(mesh, rng.standard_normal((2 * 3, 24)).astype(np.float32))

  def loss(reduce, v):
    tree = reduce({"sq": v * v, "sin": jnp.sin(v[:, :5]), "row": v[:, 0]}, "x")
    return jnp.sum(tree["sq"] * v) + jnp.sum(tree["sin"] ** 2) + jnp.sum(tree["row"] * v[:, 1])

  with fresh_communicator() as comm, b12x_jax.channel("packed-ad"):
    ours, theirs = _both(mesh, lambda r, v: jax.grad(lambda u: loss(r, u))(v), x, out_specs=P("x"))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    assert any("3 leaves packed" in d.reason for d in comm.decisions)
    body = lambda r, v: jax.vmap(lambda row: r({"row": row, "half": row[:12] * 3}, "x"))(v)  # noqa: E731
    ours, theirs = _both(mesh, body, x)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
      np.testing.assert_allclose(a, b, rtol=1e-6)


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


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 1, 2, 0]], ids=["in order", "permuted"])
def test_a_nested_shard_map_over_the_abstract_mesh_reduces_like_psum(order):
  # A nested shard_map takes the context's abstract mesh, which has no devices: b12x finds them in the
  # enclosing shard_map's mesh (it failed with "AbstractMesh does not implement devices").
  mesh = jax.make_mesh((2, 2), ("x", "y"), devices=[jax.devices("cpu")[k] for k in order])
  x = _sharded(mesh, np.random.default_rng(17).standard_normal(4 * 64).astype(np.float32), P(("x", "y")))
  outs = []
  for reduce in (b12x_jax.all_reduce, jax.lax.psum):
    inner = jax.shard_map(lambda v, r=reduce: r(r(v, "x") * 2, "y"), in_specs=P("y"), out_specs=P("y"),
                          axis_names={"y"})
    outs.append(np.asarray(jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                                 axis_names={"x"}))(x)))
    if reduce is b12x_jax.all_reduce:
      assert [d.path for d in b12x_jax.get_communicator().decisions[-2:]] == ["b12x", "b12x"]
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("automatic", [2, 1])
def test_a_shard_map_manual_over_some_axes_only_takes_psum_with_its_sharding(axis_type, automatic):
  # A custom call has no partitioning rule: XLA gathered the operand over the automatic axis before it
  # (an all-gather psum does not have, the result replicated), a packed pytree sharded over an
  # Explicit axis crashed in ravel, and an automatic axis of one device aborted the process in
  # XLA's sharding of the custom call. Every op takes its fallback there, and says why.
  kind = getattr(jax.sharding.AxisType, axis_type)
  mesh = jax.make_mesh((2, automatic), ("a", "b"), axis_types=(kind, kind), devices=jax.devices("cpu")[:2 * automatic])
  rng = np.random.default_rng(23)
  x = _sharded(mesh, rng.standard_normal((16, 16)).astype(np.float32), P("a", "b"))
  results = []
  for reduce in (b12x_jax.all_reduce, jax.lax.psum):
    fn = jax.jit(jax.shard_map(lambda v, r=reduce: r((v, v[:2] * 3), "a"), mesh=mesh, in_specs=P("a"),
                               out_specs=(P(), P()), axis_names={"a"}))
    results.append((fn(x), fn.lower(x).compile().as_text()))
  (got, hlo), (want, psum_hlo) = results
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert g.sharding.spec == w.sharding.spec, (g.sharding, w.sharding)
  for op in ("custom-call", "all-gather"):
    assert hlo.count(op) == psum_hlo.count(op), (op, hlo)
  reasons = {d.reason for d in b12x_jax.get_communicator().decisions[-2:]}
  assert reasons == {"the enclosing jax.shard_map leaves mesh axes ('b',) to the partitioner, which cannot "
                     "split a b12x call over them"}, b12x_jax.get_communicator().decisions[-2:]

  outs, lses, want_out, want_lse = attention_shards(rng, 2, 2, 4, 64, jnp.bfloat16)
  merge = jax.jit(jax.shard_map(lambda o, s: b12x_jax.dcp_a2a(o[0], s[0], "a", return_lse=True), mesh=mesh,
                                in_specs=(P("a"), P("a")), out_specs=(P(None, "a"), P(None, "a")),
                                axis_names={"a"}))
  got_out, got_lse = merge(_sharded(mesh, outs, P("a")), _sharded(mesh, lses, P("a")))
  decision = b12x_jax.get_communicator().decisions[-1]
  assert decision.op == "dcp_a2a" and "leaves mesh axes ('b',)" in decision.reason, decision
  assert_merge_matches(np.moveaxis(np.asarray(got_out, np.float64).reshape(2, 2, 2, 64), 1, 0),
                       np.asarray(got_lse).reshape(2, 2, 2).transpose(1, 0, 2), outs, want_out, want_lse, "bfloat16")


def test_a_shard_map_given_an_abstract_mesh_alone_says_what_to_pass(cpu_mesh):
  mesh = cpu_mesh(2)
  fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh.abstract_mesh, in_specs=P("x"),
                             out_specs=P("x")))
  with pytest.raises(ValueError, match=r"b12x_jax\.all_reduce: the devices of the shard_map's abstract mesh .* "
                                       r"pass jax\.shard_map a concrete mesh \(mesh=jax\.make_mesh"):
    fn(_sharded(mesh, np.ones(8, np.float32)))


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


# -- vmap of dcp_a2a and the fused op (one call of the folded batches) ------------------------------------


def _b12x_calls(fn, *args, target: str) -> list[str]:
  """The lines of ``fn``'s lowered text that call the custom call ``target``."""
  return [ln for ln in fn.lower(*args).as_text().splitlines() if f"custom_call @{target}(" in ln]


def _vmapped_dcp(mesh, vmaps: int, in_axis: int, lse_base: str = "e", return_lse: bool = True):
  """dcp_a2a under ``vmaps`` nested jax.vmap (batch dim ``in_axis`` of the
  outermost), inside shard_map over ``mesh``: inputs [n * V, ...] (one [V,
  ...] per rank), results [n, V..., B, H/n, ...] (out, and lse with
  ``return_lse``)."""
  def merge(o, l):
    return b12x_jax.dcp_a2a(o, l, "x", return_lse=return_lse, lse_base=lse_base)
  for _ in range(vmaps - 1):
    merge = jax.vmap(merge)
  merge = jax.vmap(merge, in_axes=in_axis)

  def body(o, l):
    return jax.tree.map(lambda r: r[None], merge(o, l))
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))


@pytest.mark.parametrize("vmaps,in_axis,lse_base,return_lse", [(1, 0, "e", True), (1, 1, "e", True),
                                                                (2, 0, "e", True), (1, 0, "2", False)])
def test_vmap_of_dcp_a2a_is_one_call_over_the_folded_batch(cpu_mesh, vmaps, in_axis, lse_base, return_lse):
  n, batch, heads, dim = 2, 2, 8, 64
  vmapped = (3, 2)[:vmaps]
  mesh = cpu_mesh(n)
  rng = np.random.default_rng([7, vmaps, in_axis, return_lse])
  fn = _vmapped_dcp(mesh, vmaps, in_axis, lse_base, return_lse)
  with fresh_communicator(poison_outputs=True) as comm, b12x_jax.channel("dcp-vmap"):
    for _ in range(2):  # fresh inputs, both staging slots
      rows = int(np.prod(vmapped)) * batch
      outs, lses, want, want_lse = attention_shards(rng, n, rows, heads, dim, jnp.bfloat16, base2=lse_base == "2")
      o = outs.reshape(n, *vmapped, batch, heads, dim)
      l = lses.reshape(n, *vmapped, batch, heads)
      if in_axis == 1:  # the vmapped dim after B
        o, l = o.swapaxes(1, 2), l.swapaxes(1, 2)
      args = [_sharded(mesh, a.reshape(n * a.shape[1], *a.shape[2:])) for a in (o, l)]
      got, got_lse = (np.asarray(r) for r in fn(*args)) if return_lse else (np.asarray(fn(*args)), None)
      assert got.shape == (n, *vmapped, batch, heads // n, dim)
      assert_merge_matches(got.reshape(n, rows, heads // n, dim),
                           got_lse.reshape(n, rows, heads // n) if return_lse else None, outs, want, want_lse,
                           "bfloat16")
    assert [d.path for d in comm.decisions if d.op == "dcp_a2a"][-1] == "b12x"
    calls = _b12x_calls(fn, *args, target="b12x_dcp_a2a")
    assert len(calls) == 1 and f"tensor<{rows}x{heads}x{dim}xbf16>" in calls[0], calls


def test_vmap_of_dcp_a2a_chooses_the_path_for_the_folded_size(cpu_mesh):
  # 8 rows of 132 staged bytes fit capacity_bytes (with the 64 blocks' rounding), 4 x 8 do not.
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(8)
  outs, lses, want, want_lse = attention_shards(rng, 2, 4 * 2, 8, 64, jnp.bfloat16)
  fn = _vmapped_dcp(mesh, 1, 0)
  args = [_sharded(mesh, a.reshape(2 * 4, 2, *a.shape[2:])) for a in (outs, lses)]
  # No Lamport window: the barrier protocol's staging is what the folded size overflows.
  with fresh_communicator(capacity_bytes=12288, lamport_bytes=0) as comm, b12x_jax.channel("dcp-vmap-big"):
    got, got_lse = (np.asarray(r).reshape(2, 8, 4, *r.shape[4:]) for r in fn(*args))
    assert_merge_matches(got, got_lse, outs, want, want_lse, "bfloat16")
    decision = [d for d in comm.decisions if d.op == "dcp_a2a"][-1]
    assert decision.path == "all_to_all" and "exceeds capacity_bytes=12288" in decision.reason, decision
    assert not _b12x_calls(fn, *args, target="b12x_dcp_a2a")
    unbatched = _per_rank_dcp(mesh)
    got, got_lse = (np.asarray(r).reshape(2, 2, *r.shape[1:]) for r in unbatched(
        *[_sharded(mesh, a[:, :2].reshape(4, *a.shape[2:])) for a in (outs, lses)]))
    assert [d for d in comm.decisions if d.op == "dcp_a2a"][-1].path == "b12x"
    assert_merge_matches(got, got_lse, outs[:, :2], want[:2], want_lse[:2], "bfloat16")


def _per_rank_dcp(mesh):
  body = lambda o, l: b12x_jax.dcp_a2a(o, l, "x", return_lse=True)  # noqa: E731
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))


def test_dcp_a2a_over_a_vmap_axis_name_takes_all_to_all_or_raises(cpu_mesh):
  """Over a vmap axis of size 2 the sources are the 2 batches: each rank
  merges its own pair, as the jnp merge would."""
  n, sources, batch, heads, dim = 2, 2, 2, 4, 64
  mesh = cpu_mesh(n)
  rng = np.random.default_rng(9)
  per_rank = [attention_shards(rng, sources, batch, heads, dim, jnp.bfloat16) for _ in range(n)]
  merge = jax.vmap(lambda o, l: b12x_jax.dcp_a2a(o, l, "v", return_lse=True), axis_name="v")
  # check_vma=False: jax 0.11.2's all_to_all over a vmap axis inside shard_map fails its type check.
  fn = jax.jit(jax.shard_map(lambda o, l: jax.tree.map(lambda r: r[None], merge(o, l)), mesh=mesh,
                             in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x")), check_vma=False))
  args = [_sharded(mesh, np.stack([p[i] for p in per_rank]).reshape(n * sources, *per_rank[0][i].shape[1:]))
          for i in (0, 1)]
  with fresh_communicator() as comm, b12x_jax.channel("dcp-vmap-name"):
    got, got_lse = (np.asarray(r) for r in fn(*args))  # [n, sources, B, H/sources, ...]
    assert "'v' is not a jax.shard_map mesh axis" in comm.decisions[-1].reason, comm.decisions[-1]
    assert comm.decisions[-1].path == "all_to_all"
  for r, (outs, _, want, want_lse) in enumerate(per_rank):
    assert_merge_matches(got[r], got_lse[r], outs, want, want_lse, "bfloat16")
  with fresh_communicator(policy="strict"), b12x_jax.channel("dcp-vmap-name"), pytest.raises(
      b12x_jax.IneligibleError, match=r"b12x_jax.dcp_a2a: axis 'v' is not a jax.shard_map mesh axis"):
    fn.lower(*args)


def test_grad_of_a_vmapped_dcp_a2a_matches_its_fallback_formula(cpu_mesh):
  from b12x_jax.ops.dcp_a2a import _all_to_all_path
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(10)
  outs, lses, *_ = attention_shards(rng, 2, 3 * 2, 8, 64, jnp.bfloat16)
  args = [_sharded(mesh, a.reshape(2 * 3, 2, *a.shape[2:])) for a in (outs, lses)]

  def merge(o, l, use_b12x):
    if use_b12x:
      return b12x_jax.dcp_a2a(o, l, "x", return_lse=True)
    return tuple(_all_to_all_path(o, l, axis_name="x", base2=False, return_lse=True))

  def loss(o, l, use_b12x):
    merged, merged_lse = jax.vmap(lambda a, b: merge(a, b, use_b12x))(o, l)
    return jnp.sum(merged.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(merged_lse))

  grads = []
  with fresh_communicator() as comm, b12x_jax.channel("dcp-vmap-grad"):
    for use_b12x in (True, False):
      fn = jax.jit(jax.shard_map(jax.grad(lambda o, l: loss(o, l, use_b12x), argnums=(0, 1)), mesh=mesh,
                                 in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x")), check_vma=False))
      grads.append([np.asarray(g, np.float32) for g in fn(*args)])
    assert {d.path for d in comm.decisions if d.op == "dcp_a2a"} == {"b12x"}
  assert all(np.abs(g).max() > 0 for g in grads[1])
  for ours, theirs in zip(*grads):
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-4)


def _vmapped_fused(mesh, vmaps: int, in_axis: int, batched_residual: bool = True, batched_weight: bool = False):
  """all_reduce_residual_rmsnorm under ``vmaps`` nested jax.vmap (batch dim
  ``in_axis`` of the outermost for x and a batched residual; a batched
  weight [V, hidden] at 0), inside shard_map over ``mesh``: x [n, ...] (one
  [...] per rank), residual and weight replicated; results [n, V..., rows,
  hidden]."""
  def fused(x, residual, weight):
    return b12x_jax.all_reduce_residual_rmsnorm(x, residual, weight, "x")
  for _ in range(vmaps - 1):
    fused = jax.vmap(fused, in_axes=(0, 0 if batched_residual else None, 0 if batched_weight else None))
  fused = jax.vmap(fused, in_axes=(in_axis, in_axis if batched_residual else None, 0 if batched_weight else None))

  def body(x, residual, weight):
    return jax.tree.map(lambda r: r[None], fused(x, residual, weight))
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=(P("x"), P("x")),
                               check_vma=False))


def _check_fused(fn, mesh, rng, vmapped: tuple, in_axis: int, rows: int, hidden: int, *, batched_residual=True,
                 batched_weight=False, dtype_name="float32"):
  """Runs ``fn`` (_vmapped_fused) on fresh inputs; every batch against float64."""
  n, count = mesh.devices.size, int(np.prod(vmapped))
  shards, residual, weight = residual_rmsnorm_inputs(rng, n, count * rows, hidden, dtype_name)
  residuals = residual.reshape(count, rows, hidden) if batched_residual else np.broadcast_to(
      residual[:rows], (count, rows, hidden))
  weights = (1 + 0.1 * rng.standard_normal((count, hidden))).astype(weight.dtype) if batched_weight else \
      np.broadcast_to(weight, (count, hidden))
  x = shards.reshape(n, *vmapped, rows, hidden)
  res = residuals.reshape(*vmapped, rows, hidden) if batched_residual else residual[:rows]
  w = weights.reshape(*vmapped, hidden) if batched_weight else weight
  if in_axis == 1:
    x, res = x.swapaxes(1, 2), (res.swapaxes(0, 1) if batched_residual else res)
  x = _sharded(mesh, x.reshape(n * x.shape[1], *x.shape[2:]))
  normed, new_residual = (np.asarray(r).reshape(n, count, rows, hidden) for r in fn(x, res, w))
  for b in range(count):
    assert_residual_rmsnorm_matches(normed[:, b], new_residual[:, b], shards.reshape(n, count, rows, hidden)[:, b],
                                    residuals[b], weights[b], 1e-6, dtype_name)
  return x, res, w


@pytest.mark.parametrize("vmaps,in_axis,batched_residual", [(1, 0, True), (1, 1, True), (1, 0, False), (2, 0, True)])
def test_vmap_of_the_fused_op_is_one_fused_call(cpu_mesh, vmaps, in_axis, batched_residual):
  mesh = cpu_mesh(2)
  vmapped, rows, hidden = (3, 2)[:vmaps], 2, 64
  fn = _vmapped_fused(mesh, vmaps, in_axis, batched_residual)
  rng = np.random.default_rng([11, vmaps, in_axis, batched_residual])
  with fresh_communicator(poison_outputs=True) as comm, b12x_jax.channel("fused-vmap"):
    for _ in range(2):
      args = _check_fused(fn, mesh, rng, vmapped, in_axis, rows, hidden, batched_residual=batched_residual)
    assert comm.decisions[-1].op == "all_reduce_residual_rmsnorm" and comm.decisions[-1].path == "b12x"
    calls = _b12x_calls(fn, *args, target="b12x_residual_rmsnorm")
    leading = "x".join(str(v) for v in vmapped)
    assert len(calls) == 1 and f"tensor<{leading}x{rows}x{hidden}xf32>" in calls[0], calls
    assert not _b12x_calls(fn, *args, target="b12x_all_reduce")


def test_vmap_of_the_fused_op_with_a_batched_weight_or_too_many_rows_is_unfused(cpu_mesh):
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(12)
  with fresh_communicator() as comm, b12x_jax.channel("fused-vmap-weight"):
    fn = _vmapped_fused(mesh, 1, 0, batched_weight=True)
    args = _check_fused(fn, mesh, rng, (3,), 0, 2, 64, batched_weight=True)
    assert "the weight is batched" in [d for d in comm.decisions if d.path == "unfused"][-1].reason
    assert not _b12x_calls(fn, *args, target="b12x_residual_rmsnorm")
    calls = _b12x_calls(fn, *args, target="b12x_all_reduce")
    assert len(calls) == 1 and "tensor<3x2x64xf32>" in calls[0], calls
  # 4 rows of 256 bytes fit a Lamport window of 2048 bytes; 4 x 4 rows do not.
  with fresh_communicator(lamport_bytes=2048) as comm, b12x_jax.channel("fused-vmap-rows"):
    fn = _vmapped_fused(mesh, 1, 0)
    args = _check_fused(fn, mesh, rng, (4,), 0, 4, 64)
    unfused = [d for d in comm.decisions if d.path == "unfused"]
    assert unfused and "exceed the 1 Lamport cells of 2048 bytes" in unfused[-1].reason, comm.decisions
    assert not _b12x_calls(fn, *args, target="b12x_residual_rmsnorm")
    unbatched = residual_rmsnorm_fn(mesh)
    shards, residual, weight = residual_rmsnorm_inputs(rng, 2, 4, 64, "float32")
    unbatched(_sharded(mesh, shards), residual, weight)
    assert comm.decisions[-1].op == "all_reduce_residual_rmsnorm" and comm.decisions[-1].path == "b12x"


def test_the_fused_op_over_a_vmap_axis_name_is_unfused_or_raises(cpu_mesh):
  mesh = cpu_mesh(2)
  sources, rows, hidden = 2, 2, 64
  rng = np.random.default_rng(13)
  per_rank = [residual_rmsnorm_inputs(rng, sources, rows, hidden, "float32") for _ in range(2)]
  fused = jax.vmap(lambda v, r, w: b12x_jax.all_reduce_residual_rmsnorm(v, r, w, "v"), in_axes=(0, None, None),
                   axis_name="v")
  x = _sharded(mesh, np.stack([p[0] for p in per_rank]).reshape(2 * sources, rows, hidden))
  residuals = np.stack([p[1] for p in per_rank])
  weights = np.stack([p[2] for p in per_rank])
  fn = jax.jit(jax.shard_map(lambda v, r, w: jax.tree.map(lambda t: t[None], fused(v, r[0], w[0])), mesh=mesh,
                             in_specs=(P("x"), P("x"), P("x")), out_specs=(P("x"), P("x")), check_vma=False))
  args = (x, _sharded(mesh, residuals), _sharded(mesh, weights))
  with fresh_communicator() as comm, b12x_jax.channel("fused-vmap-name"):
    normed, new_residual = (np.asarray(t) for t in fn(*args))  # [n, sources, rows, hidden]
    fused_decision = [d for d in comm.decisions if d.op == "all_reduce_residual_rmsnorm"][-1]
    assert fused_decision.path == "unfused" and "'v' is not a jax.shard_map mesh axis" in fused_decision.reason
  for r, (shards, residual, weight) in enumerate(per_rank):
    assert_residual_rmsnorm_matches(normed[r], new_residual[r], shards, residual, weight, 1e-6, "float32")
  with fresh_communicator(policy="strict"), b12x_jax.channel("fused-vmap-name"), pytest.raises(
      b12x_jax.IneligibleError,
      match=r"b12x_jax.all_reduce_residual_rmsnorm: axis 'v' is not a jax.shard_map mesh axis"):
    fn.lower(*args)


def test_grad_of_a_vmapped_fused_op_matches_its_jnp_equivalent(cpu_mesh):
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(14)
  x = _sharded(mesh, rng.standard_normal((2 * 3, 2, 64)).astype(np.float32))
  res = jnp.asarray(rng.standard_normal((3, 2, 64)).astype(np.float32))
  w = jnp.asarray((1 + 0.1 * rng.standard_normal(64)).astype(np.float32))

  def reference(v, r):
    total = jax.lax.psum(v, "x") + r
    return total * jax.lax.rsqrt(jnp.mean(total * total, -1, keepdims=True) + 1e-6) * w, total

  def loss(fused, v):
    normed, new_residual = jax.vmap(fused)(v, res)
    return jnp.sum(normed * jnp.cos(new_residual))

  grads = []
  with fresh_communicator() as comm, b12x_jax.channel("fused-vmap-grad"):
    for fused in (lambda v, r: b12x_jax.all_reduce_residual_rmsnorm(v, r, w, "x"), reference):
      fn = jax.jit(jax.shard_map(jax.grad(lambda v: loss(fused, v)), mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                 check_vma=False))
      grads.append(np.asarray(fn(x)))
    assert [d.path for d in comm.decisions if d.op == "all_reduce_residual_rmsnorm"][-1] == "b12x"
  assert np.abs(grads[1]).max() > 0
  np.testing.assert_allclose(grads[0], grads[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lse_base", ["e", "2"])
@pytest.mark.parametrize("return_lse", [False, True])
def test_dcp_a2a_gradients_match_the_merge_derived_by_hand_in_float64(cpu_mesh, lse_base, return_lse):
  # Not the fallback's jnp derivative, which the b12x path borrows: with w_s = base**(lse_s - m) and W = sum_s w_s,
  # d merged / d out_s = w_s / W, d merged / d lse_s = k w_s / W (out_s - merged) (k = ln 2 for base 2, else 1),
  # d merged_lse / d lse_s = w_s / W. The loss sums every rank's: sum(merged**2) + sum(c * merged_lse).
  n, batch, heads, dim = 2, 2, 4, 16
  mesh = cpu_mesh(n)
  rng = np.random.default_rng(21 + len(lse_base) + return_lse)
  outs = rng.standard_normal((n, batch, heads, dim)).astype(np.float32).astype(jnp.bfloat16)  # [source, B, H, D]
  lses = (2 * rng.standard_normal((n, batch, heads))).astype(np.float32)
  c = rng.standard_normal((n, batch, heads // n)).astype(np.float32)  # per destination rank

  def loss(o, l, cr):
    merged = b12x_jax.dcp_a2a(o, l, "x", return_lse=return_lse, lse_base=lse_base)
    if not return_lse:
      return jnp.sum(merged.astype(jnp.float32) ** 2)
    return jnp.sum(merged[0].astype(jnp.float32) ** 2) + jnp.sum(cr * merged[1])

  grad = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh, in_specs=(P("x"), P("x"), P("x")),
                               out_specs=(P("x"), P("x")), check_vma=False))
  with fresh_communicator(poison_outputs=True) as comm, b12x_jax.channel("dcp-grad"):
    got_out, got_lse = (np.asarray(g, np.float64).reshape(n, batch, heads, -1)
                        for g in grad(_sharded(mesh, outs.reshape(n * batch, heads, dim)),
                                      _sharded(mesh, lses.reshape(n * batch, heads)),
                                      _sharded(mesh, c.reshape(n * batch, heads // n))))
    assert any(d.op == "dcp_a2a" and d.path == "b12x" for d in comm.decisions), comm.decisions
  o, lse = outs.astype(np.float64), lses.astype(np.float64)
  k = np.log(2.0) if lse_base == "2" else 1.0
  w = np.exp(k * (lse - lse.max(axis=0)))
  share = w / w.sum(axis=0)  # [source, B, H]
  merged = (share[..., None] * o).sum(axis=0)  # [B, H, D]: head h is merged on rank h // (heads // n)
  cot = 2 * merged.astype(jnp.bfloat16).astype(np.float64)  # d loss / d merged, at the rounded output
  want_out = share[..., None] * cot[None]
  want_lse = k * share * ((o - merged[None]) * cot[None]).sum(axis=-1)
  if return_lse:
    want_lse = want_lse + share * c.transpose(1, 0, 2).reshape(batch, heads)[None]
  scale = np.abs(want_out).max()
  np.testing.assert_allclose(got_out[..., :dim], want_out, atol=2e-2 * scale)
  np.testing.assert_allclose(got_lse[..., 0], want_lse, atol=2e-2 * np.abs(want_lse).max())
