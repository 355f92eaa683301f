"""The custom calls carry no side effect (docs/DESIGN.md, "Call order"): the
channel's order token keeps every call whose result is read, once, in
program order. XLA may merge (CSE), drop (DCE) or move a side-effect-free
instruction; these tests show what happens to b12x calls: two identical
calls on identical inputs both run (each takes the other's token), a call
whose result nobody reads is dropped from the program, as a psum would be,
so on every rank alike, and the compiled module holds every other call.
The order itself is tests/test_order.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_sum_matches, put_sharded, random_shards
from jax.sharding import PartitionSpec as P

import b12x_jax


def _epochs(comm, channel: str, mesh) -> list[int]:
  return [comm.stats(channel, d)["epoch"] for d in mesh.devices.flat]


def _compiled_calls(fn, *args) -> int:
  """b12x custom calls in the optimized HLO XLA runs."""
  return len(re.findall(r'custom_call_target="b12x_all_reduce"', fn.lower(*args).compile().as_text()))


def test_two_identical_calls_on_identical_inputs_both_run(cpu_mesh):
  mesh = cpu_mesh(2)
  fn = jax.jit(jax.shard_map(lambda v: (b12x_jax.all_reduce(v, "x"), b12x_jax.all_reduce(v, "x")), mesh=mesh,
                             in_specs=P("x"), out_specs=(P(), P())))
  comm = b12x_jax.get_communicator()
  rng = np.random.default_rng(41)
  with b12x_jax.channel("twins"):
    shards = random_shards(rng, 2, 256, np.float32)
    x = put_sharded(mesh, shards)
    assert _compiled_calls(fn, x) == 2  # not merged into one
    jax.block_until_ready(fn(x))
    before = _epochs(comm, "twins", mesh)
    for _ in range(3):
      shards = random_shards(rng, 2, 256, np.float32)
      first, second = fn(put_sharded(mesh, shards))
      for got in (first, second):
        assert_sum_matches(np.asarray(got).reshape(1, -1), shards, "float32")
    assert [e - b for e, b in zip(_epochs(comm, "twins", mesh), before)] == [6, 6]  # 2 calls per run, 3 runs


@pytest.mark.parametrize("where", ["straight", "scan"])
def test_a_call_whose_result_is_unused_is_dropped_on_every_rank_as_a_psum_would_be(cpu_mesh, where):
  mesh = cpu_mesh(2)

  def body(v):
    if where == "straight":
      b12x_jax.all_reduce(v, "x")
    else:
      jax.lax.scan(lambda c, _: (c, b12x_jax.all_reduce(c, "x")), v, None, length=3)
    return b12x_jax.all_reduce(v, "x") * 2  # the call whose result is read runs

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  comm = b12x_jax.get_communicator()
  rng = np.random.default_rng(43)
  channel = f"unused-{where}"
  with b12x_jax.channel(channel):
    shards = random_shards(rng, 2, 64, np.float32)
    x = put_sharded(mesh, shards)
    assert _compiled_calls(fn, x) == 1  # the program has no call whose result nobody reads
    assert_sum_matches(np.asarray(fn(x)).reshape(2, -1) / 2, shards, "float32")
    before = _epochs(comm, channel, mesh)
    fn(x).block_until_ready()
    assert [e - b for e, b in zip(_epochs(comm, channel, mesh), before)] == [1, 1]  # every rank ran the same calls


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_the_emitted_calls_have_no_side_effect_and_take_the_channel_token(cpu_mesh, platform):
  mesh = cpu_mesh(2)
  fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(b12x_jax.all_reduce(v, "x"), "x"), mesh=mesh,
                             in_specs=P("x"), out_specs=P()))
  x = jax.ShapeDtypeStruct((128,), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P("x")))
  with b12x_jax.channel("emitted"):
    text = fn.trace(x).lower(lowering_platforms=(platform,)).as_text()
  calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @b12x_all_reduce" in ln]
  assert len(calls) == 2
  for line in calls:
    assert "has_side_effect = true" not in line
    assert re.search(r"custom_call @b12x_all_reduce\(%[\w#]+, %[\w#]+\)", line), line  # (token, payload)
    assert re.search(r"-> \(!stablehlo.token, tensor<", line), line  # (token, result)
