"""dcp_a2a on 2 CUDA GPUs of one process (marked gpu; skipped below 2).

Value tests run with ``poison_outputs``: out and lse are NaN before the
kernel writes them, so a row the kernel misses fails the test."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import b12x_jax
from conftest import requires_2_gpus, run_worker
from helpers import DTYPES, assert_merge_matches, attention_shards, fresh_communicator

pytestmark = [pytest.mark.gpu, requires_2_gpus]
N = 2


def _mesh():
  return jax.make_mesh((N,), ("x",), devices=jax.devices("gpu")[:N])


def _per_rank_merge(mesh, lse_base):
  return jax.jit(jax.shard_map(lambda o, l: b12x_jax.dcp_a2a(o, l, "x", return_lse=True, lse_base=lse_base),
                               mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))


def _put(mesh, host):
  return jax.device_put(host.reshape((-1,) + host.shape[2:]), NamedSharding(mesh, P("x")))


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("batch, heads, dim", [(1, 32, 128), (8, 32, 128), (256, 32, 128), (64, 128, 128),
                                               (16, 32, 512), (5, 6, 64)])
@pytest.mark.parametrize("lse_base", ["e", "2"])
def test_merge_matches_float64_attention_on_every_rank(dtype_name, batch, heads, dim, lse_base):
  mesh = _mesh()
  fn = _per_rank_merge(mesh, lse_base)
  rng = np.random.default_rng([batch, heads, dim])
  with fresh_communicator(poison_outputs=True), b12x_jax.channel("values"):
    for _ in range(3):  # fresh inputs each call, both staging slots
      outs, lses, want, want_lse = attention_shards(rng, N, batch, heads, dim, DTYPES[dtype_name], kv=4,
                                                    base2=lse_base == "2", empty=((0, 0, 0), (1, batch - 1, 1)),
                                                    all_empty=((batch - 1, heads - 1),))
      got, got_lse = fn(_put(mesh, outs), _put(mesh, lses))
      assert_merge_matches(np.asarray(got).reshape(N, batch, heads // N, dim),
                           np.asarray(got_lse).reshape(N, batch, heads // N), outs, want, want_lse, dtype_name)
    assert b12x_jax.get_communicator().decisions[-1].path == "b12x"
    b12x_jax.check_errors()


@pytest.mark.parametrize("graphs", ["on", "off"])
def test_merges_interleaved_with_all_reduces_run_100_times_with_cuda_graphs_on_and_off(graphs):
  flags = "" if graphs == "on" else "--xla_gpu_enable_command_buffer="
  result = run_worker("dcp", "--platform", "gpu", "--runs", "100", f"--xla-flags={flags}", hard_timeout=300)
  assert result["paths"] == ["b12x"]
  assert result["epoch"] == result["expected"]


def test_target_and_draft_merges_alternate_on_separate_channels():
  mesh = _mesh()
  fn = _per_rank_merge(mesh, "e")
  rng = np.random.default_rng(7)
  comm = b12x_jax.get_communicator()
  counts = {name: comm.stats(name, jax.devices("gpu")[0])["epoch"] if name in comm.prepared_channels() else 0
            for name in ("target", "draft")}
  for name in rng.choice(["target", "draft"], size=40, p=[0.7, 0.3]):
    outs, lses, want, want_lse = attention_shards(rng, N, 8, 32, 128, jnp.bfloat16, kv=4)
    with b12x_jax.channel(str(name)):
      got, got_lse = fn(_put(mesh, outs), _put(mesh, lses))
    assert_merge_matches(np.asarray(got).reshape(N, 8, 16, 128), np.asarray(got_lse).reshape(N, 8, 16), outs, want,
                         want_lse, "bfloat16")
    counts[str(name)] += 1
  for name, calls in counts.items():
    for device in jax.devices("gpu")[:N]:
      assert comm.stats(name, device)["epoch"] == calls


def test_a_peer_that_never_joins_a_merge_raises_the_timeout_error():
  result = run_worker("timeout", "--platform", "gpu", "--op", "dcp_a2a", "--timeout", "1.0", hard_timeout=120)
  assert len(result["messages"]) == 2, result
  assert result["nan_outputs"] == [True], result  # the timed-out kernel's output, never a stale number
  for message in result["messages"]:
    assert "channel 'lonely'" in message and "rank 0" in message and "rank 1" in message and "epoch" in message
  assert result["seconds"] < 60
