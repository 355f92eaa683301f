"""The types b12x calls infer inside shard_map (DESIGN C19: a drop-in for
psum): the varying manual axes of every result are those of the psum / jnp
equivalent, so ``check_vma`` accepts and rejects the same ``out_specs``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import b12x_jax
from b12x_jax import _compat
from helpers import fresh_communicator

# Input specs over a (2, 2) mesh ("a", "x"): invariant, varying over the
# other axis, over the reduced axis, over both.
SPECS = [P(), P("a"), P("x"), P(("a", "x"))]


def _mesh(shape=(2, 2), names=("a", "x")):
  return jax.make_mesh(shape, names, devices=jax.devices("cpu")[:4])


def _global(mesh, spec, shape):
  """The global shape whose shards under ``spec`` have ``shape``."""
  sizes = dict(mesh.shape)
  factors = [1 if e is None else
             math.prod(sizes[a] for a in (e if isinstance(e, tuple) else (e,)))
             for e in (*spec, *[None] * (len(shape) - len(spec)))]
  return tuple(d * f for d, f in zip(shape, factors))


def _varying(fn, mesh, specs, shapes, dtypes):
  """The varying axes of each result of ``fn`` traced inside shard_map over
  ``mesh`` with ``specs``, its arguments' shards of ``shapes`` (no
  execution, no preparation)."""
  seen = []

  def body(*args):
    results = fn(*args)
    seen.extend(sorted(_compat.varying_axes(jax.typeof(r))) for r in jax.tree.leaves(results))
    return results

  args = [jax.ShapeDtypeStruct(_global(mesh, spec, shape), dtype, sharding=NamedSharding(mesh, spec))
          for shape, dtype, spec in zip(shapes, dtypes, specs)]
  jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=P(mesh.axis_names))).trace(*args)
  return seen


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("mesh_shape", [(2, 2), (4, 1)])
def test_all_reduce_infers_the_varying_axes_of_psum(mesh_shape, spec):
  mesh = _mesh(mesh_shape)  # (4, 1): the reduced axis "x" has size 1
  args = (mesh, [spec], [(4, 16)], [jnp.float32])
  assert _varying(lambda x: b12x_jax.all_reduce(x, "x"), *args) == _varying(lambda x: jax.lax.psum(x, "x"), *args)


def _rmsnorm_reference(x, residual, weight):
  new_residual = jax.lax.psum(x, "x") + residual
  return new_residual * jax.lax.rsqrt(jnp.mean(new_residual**2, -1, keepdims=True) + 1e-6) * weight, new_residual


@pytest.mark.parametrize("residual_spec", SPECS)
@pytest.mark.parametrize("x_spec", SPECS)
def test_residual_rmsnorm_infers_the_varying_axes_of_its_jnp_equivalent(x_spec, residual_spec):
  for weight_spec in (P(), P("a")):
    args = (_mesh(), [x_spec, residual_spec, weight_spec], [(8, 64), (8, 64), (64,)], [jnp.float32] * 3)
    assert (_varying(lambda x, r, w: b12x_jax.all_reduce_residual_rmsnorm(x, r, w, "x"), *args)
            == _varying(_rmsnorm_reference, *args))


@pytest.mark.parametrize("lse_spec", SPECS)
@pytest.mark.parametrize("out_spec", SPECS)
def test_dcp_a2a_infers_the_varying_axes_of_its_all_to_all_path(out_spec, lse_spec):
  args = (_mesh(), [out_spec, lse_spec], [(4, 8, 64), (4, 8)], [jnp.bfloat16, jnp.float32])
  merge = lambda out, lse: b12x_jax.dcp_a2a(out, lse, "x", return_lse=True)  # noqa: E731
  b12x = _varying(merge, *args)
  with fresh_communicator(policy="psum"):  # all_to_all plus the merge in jnp
    assert b12x == _varying(merge, *args)


def test_a_residual_varying_over_another_axis_cannot_leave_replicated():
  # as with the jnp equivalent, out_specs=P() is rejected, not silently collapsed
  mesh = _mesh()
  fused = lambda x, r, w: b12x_jax.all_reduce_residual_rmsnorm(x, r, w, "x")  # noqa: E731
  args = [jax.ShapeDtypeStruct(_global(mesh, p, s), jnp.float32, sharding=NamedSharding(mesh, p))
          for s, p in (((8, 64), P("x")), ((8, 64), P("a")), ((64,), P()))]
  for fn in (fused, _rmsnorm_reference):
    with pytest.raises(ValueError, match=r"out_specs.*varying"):
      jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"), P("a"), P()), out_specs=P())).trace(*args)


@pytest.mark.parametrize("spec", SPECS)
def test_a_packed_pytree_keeps_each_leafs_varying_axes(spec):
  # leaves of one dtype but different varying axes are not packed together: each infers psum's type
  args = (_mesh(), [P("x"), spec, P(("a", "x"))], [(4, 16), (4, 16), (8,)], [jnp.float32] * 3)
  tree = lambda reduce: lambda a, b, c: reduce({"a": a, "b": b, "c": c}, "x")  # noqa: E731
  assert _varying(tree(b12x_jax.all_reduce), *args) == _varying(tree(jax.lax.psum), *args)
