"""all_reduce on 2 CUDA GPUs of one process (marked gpu; skipped below 2)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import b12x_jax
from conftest import requires_2_gpus, run_worker
from helpers import DTYPES, assert_sum_matches, random_shards

pytestmark = [pytest.mark.gpu, requires_2_gpus]
N = 2


def _mesh():
  return jax.make_mesh((N,), ("x",), devices=jax.devices("gpu")[:N])


def _per_rank_all_reduce(mesh):
  return jax.jit(jax.shard_map(lambda x: b12x_jax.all_reduce(x, "x"), mesh=mesh, in_specs=P("x"),
                               out_specs=P("x")))


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("nbytes", [16, 4096, 65536, 1 << 20, 8 << 20])
def test_all_reduce_matches_float64_reference_on_every_rank(dtype_name, nbytes):
  dtype = DTYPES[dtype_name]
  mesh = _mesh()
  fn = _per_rank_all_reduce(mesh)
  rng = np.random.default_rng(nbytes)
  elems = nbytes // np.dtype(dtype).itemsize
  with b12x_jax.channel("values"):
    for _ in range(3):  # fresh inputs each call
      shards = random_shards(rng, N, elems, dtype)
      out = fn(jax.device_put(shards.reshape(-1), NamedSharding(mesh, P("x"))))
      assert_sum_matches(np.asarray(out).reshape(N, -1), shards, dtype_name)
  assert b12x_jax.get_communicator().decisions[-1].path == "b12x"
  b12x_jax.check_errors()


@pytest.mark.parametrize("graphs", ["on", "off"])
def test_17_all_reduces_run_200_times_with_cuda_graphs_on_and_off(graphs):
  flags = "" if graphs == "on" else "--xla_gpu_enable_command_buffer="
  result = run_worker("graphs", "--platform", "gpu", "--runs", "200", f"--xla-flags={flags}", hard_timeout=300)
  assert result["epoch"] == result["expected"]


def test_target_and_draft_alternate_on_separate_channels():
  mesh = _mesh()
  fn = _per_rank_all_reduce(mesh)
  rng = np.random.default_rng(7)
  counts = {"target": 0, "draft": 0}
  comm = b12x_jax.get_communicator()
  for name in ("target", "draft"):
    if name in comm.prepared_channels():
      counts[name] = comm.stats(name, jax.devices("gpu")[0])["epoch"]
  for name in rng.choice(["target", "draft"], size=60, p=[0.7, 0.3]):
    shards = random_shards(rng, N, 4096, np.float32)
    with b12x_jax.channel(str(name)):
      out = fn(jax.device_put(shards.reshape(-1), NamedSharding(mesh, P("x"))))
    assert_sum_matches(np.asarray(out).reshape(N, -1), shards, "float32")
    counts[str(name)] += 1
  for name, calls in counts.items():
    for device in jax.devices("gpu")[:N]:
      assert comm.stats(name, device)["epoch"] == calls


def test_a_peer_that_never_joins_raises_the_timeout_error():
  result = run_worker("timeout", "--platform", "gpu", "--timeout", "1.0", hard_timeout=120)
  assert len(result["messages"]) == 2, result
  for message in result["messages"]:
    assert "channel 'lonely'" in message and "rank 0" in message and "rank 1" in message
    assert "epoch" in message
  assert result["seconds"] < 60
