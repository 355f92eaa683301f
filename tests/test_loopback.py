"""Loopback (docs/DESIGN.md, "Loopback"): with Communicator(loopback=True)
a mesh axis of one device runs the b12x protocol as a group of one whose
peer is itself, every protocol, against float64, with poisoned outputs;
without it, such an axis is psum and prepares nothing."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import (assert_residual_rmsnorm_matches, assert_sum_matches, check_every_protocol, fresh_communicator,
                     put_sharded, random_shards, residual_rmsnorm_fn, residual_rmsnorm_inputs)
from jax.sharding import PartitionSpec as P

import b12x_jax


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot", "one_shot_pull"])
def test_every_protocol_runs_on_a_group_of_one(cpu_mesh, algorithm):
  assert check_every_protocol(cpu_mesh(1), algorithm, seed=61, loopback=True) == 30


def test_each_loopback_group_of_a_mesh_counts_its_own_calls(cpu_mesh):
  mesh = jax.make_mesh((2, 1), ("a", "x"), devices=jax.devices("cpu")[:2])
  fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("a"), out_specs=P("a")))
  rng = np.random.default_rng(67)
  with fresh_communicator(loopback=True, poison_outputs=True) as comm, b12x_jax.channel("loop"):
    for call in range(1, 4):
      shards = random_shards(rng, 2, 512, np.float32)
      got = np.asarray(fn(jax.device_put(shards.reshape(-1), jax.sharding.NamedSharding(mesh, P("a")))))
      for rank, shard in enumerate(shards):  # each group of one sums its own shard
        assert_sum_matches(got.reshape(2, -1)[rank:rank + 1], shard[None], "float32")
      assert comm.decisions[-1].path == "b12x"
      assert [comm.stats("loop", d)["epoch"] for d in mesh.devices.flat] == [call, call]
    assert sorted(comm.prepared_channels()["loop"]) == [(0,), (1,)]


def test_the_fused_op_runs_its_exchange_on_a_group_of_one(cpu_mesh):
  mesh = cpu_mesh(1)
  fn = residual_rmsnorm_fn(mesh)
  rng = np.random.default_rng(71)
  with fresh_communicator(loopback=True, poison_outputs=True) as comm, b12x_jax.channel("loop-fused"):
    for call in range(1, 3):
      shards, residual, weight = residual_rmsnorm_inputs(rng, 1, 4, 256, "bfloat16")
      normed, new_residual = fn(jax.device_put(shards, jax.sharding.NamedSharding(mesh, P("x"))), residual, weight)
      assert_residual_rmsnorm_matches(np.asarray(normed), np.asarray(new_residual), shards, residual, weight, 1e-6,
                                      "bfloat16")
      assert comm.decisions[-1].path == "b12x", comm.decisions[-1]
      assert comm.stats("loop-fused", mesh.devices.flat[0])["epoch"] == call


def test_without_loopback_an_axis_of_one_is_psum_and_prepares_nothing(cpu_mesh):
  mesh = cpu_mesh(1)
  fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  with fresh_communicator() as comm, b12x_jax.channel("no-loop"):
    shards = random_shards(np.random.default_rng(73), 1, 64, np.float32)
    np.testing.assert_array_equal(np.asarray(fn(put_sharded(mesh, shards))), shards[0])
    assert comm.decisions == [] and comm.prepared_channels() == {}


def test_loopback_must_be_a_bool():
  with pytest.raises(TypeError, match="loopback must be True or False"):
    b12x_jax.Communicator(loopback=1)


@pytest.mark.parametrize("algorithm, barriers", [("one_shot", 1), ("two_shot", 2)])
def test_the_barrier_protocol_meets_itself(cpu_mesh, algorithm, barriers):
  """The epoch advances only where a rank announced itself to a peer: a
  group of one that skipped the protocol would stay at 0."""
  mesh = cpu_mesh(1)
  fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  rng = np.random.default_rng(79)
  with fresh_communicator(loopback=True, lamport_bytes=0, algorithm=algorithm, poison_outputs=True) as comm, \
      b12x_jax.channel("loop-barrier"):
    for call in range(1, 4):
      shards = random_shards(rng, 1, 1024, np.float32)
      assert_sum_matches(np.asarray(fn(put_sharded(mesh, shards)))[None], shards, "float32")
      assert comm.stats("loop-barrier", mesh.devices.flat[0])["epoch"] == barriers * call
