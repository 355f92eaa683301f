"""A step with b12x calls dispatches like a psum step (docs/DESIGN.md, "Call
order"): no JAX effect reaches the jitted function, so its executable takes
JAX's fast dispatch path (no runtime token, no ordered effect) in every form
the calls take inside the shard_map; and benchmarks/dispatch.py, the table
of what a dispatched step costs, runs (small, on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_sum_matches, put_sharded, random_shards
from jax.sharding import PartitionSpec as P

import b12x_jax

BENCHMARKS = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")


def _bodies():
  """Calls straight, in scan, while_loop, cond, a nested jit, under
  checkpoint, of every op, on two channels."""
  def straight(v):
    return b12x_jax.all_reduce(v, "x") + b12x_jax.all_reduce(v, "x", channel="other")

  def loops(v):
    v = jax.lax.scan(lambda c, _: (b12x_jax.all_reduce(c, "x") / 2, None), v, None, length=2)[0]
    v = jax.lax.fori_loop(0, 2, lambda i, c: b12x_jax.all_reduce(c, "x") / 2, v)
    return jax.lax.cond(v[0] > -1e30, lambda c: b12x_jax.all_reduce(c, "x"), lambda c: c, v)

  def nested(v):
    return jax.jit(jax.checkpoint(lambda c: b12x_jax.all_reduce(c, "x")))(v)

  def fused(v):
    normed, new_residual = b12x_jax.all_reduce_residual_rmsnorm(v.reshape(2, -1), v.reshape(2, -1),
                                                                jnp.ones(v.size // 2, v.dtype), "x")
    return (normed + new_residual).reshape(-1)

  return {"straight": straight, "loops": loops, "nested": nested, "fused": fused}


@pytest.mark.parametrize("form", sorted(_bodies()))
def test_a_jitted_function_with_b12x_calls_carries_no_effect_and_takes_the_fast_path(cpu_mesh, form):
  mesh = cpu_mesh(2)
  fn = jax.jit(jax.shard_map(_bodies()[form], mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  x = put_sharded(mesh, random_shards(np.random.default_rng(5), 2, 128, np.float32))
  with b12x_jax.channel(f"fast-{form}"):
    assert jax.make_jaxpr(fn)(x).effects == set()
    compiled = fn.lower(x).compile()
    call = compiled._executable.unsafe_call  # what jax's dispatch reads (pjit._get_fastpath_data)
    assert call.ordered_effects == [] and not call.has_unordered_effects
    assert "stablehlo.token" not in fn.lower(x).as_text().split("func.func public @main")[1].split("{")[0]
    jax.block_until_ready(fn(x))


def test_the_fast_path_runs_the_calls_again_and_again_on_fresh_inputs(cpu_mesh):
  # jax's C++ dispatch path after the first call: every call still right.
  mesh = cpu_mesh(2)
  fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(b12x_jax.all_reduce(v, "x"), "x") / 2, mesh=mesh,
                             in_specs=P("x"), out_specs=P("x"), check_vma=False))
  rng = np.random.default_rng(9)
  with b12x_jax.channel("fast-again"):
    for _ in range(20):
      shards = random_shards(rng, 2, 256, np.float32)
      assert_sum_matches(np.asarray(fn(put_sharded(mesh, shards))).reshape(2, -1), shards, "float32")


def test_the_dispatch_benchmark_prints_its_table_beside_psum(tmp_path):
  out = tmp_path / "dispatch.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "dispatch.py"), "--steps", "10", "--repeats", "1",
                         "--calls", "1", "8", "--matmul-size", "128", "--json", str(out)],
                        capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  for row in ("tiny (1 call)", "tiny (8 calls)", "matmul (1 call)", "b12x ffi: host cost"):
    assert row in proc.stdout, proc.stdout
  table = json.loads(out.read_text())
  assert set(table["steps"]) == {"tiny/1", "tiny/8", "matmul/1"}
  for row in table["steps"].values():
    assert set(row) == {"none", "psum", "b12x ffi"}
    assert all(total >= loop > 0 for total, loop in row.values()), row
