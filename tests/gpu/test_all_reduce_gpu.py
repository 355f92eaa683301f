"""all_reduce on 2 CUDA GPUs of one process (marked gpu; skipped below 2).

Value tests run with ``poison_outputs``: every output is NaN before the
kernel writes it, so an element the kernel misses fails the test."""

from __future__ import annotations


import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import b12x_jax
from b12x_jax import _b12x
from conftest import requires_2_gpus, run_worker
from helpers import DTYPES, assert_names_both_calls, assert_sum_matches, fresh_communicator, random_shards

pytestmark = [pytest.mark.gpu, requires_2_gpus]
N = 2


def _mesh():
  return jax.make_mesh((N,), ("x",), devices=jax.devices("gpu")[:N])


def _per_rank_all_reduce(mesh):
  return jax.jit(jax.shard_map(lambda x: b12x_jax.all_reduce(x, "x"), mesh=mesh, in_specs=P("x"),
                               out_specs=P("x")))


def _check_values(nbytes: int, dtype_name: str, calls: int = 3) -> None:
  dtype = DTYPES[dtype_name]
  mesh = _mesh()
  fn = _per_rank_all_reduce(mesh)
  rng = np.random.default_rng(nbytes)
  elems = nbytes // np.dtype(dtype).itemsize
  with b12x_jax.channel("values"):
    for _ in range(calls):  # fresh inputs each call
      shards = random_shards(rng, N, elems, dtype)
      out = fn(jax.device_put(shards.reshape(-1), NamedSharding(mesh, P("x"))))
      assert_sum_matches(np.asarray(out).reshape(N, -1), shards, dtype_name)
  assert b12x_jax.get_communicator().decisions[-1].path == "b12x"
  b12x_jax.check_errors()


LAMPORT_BYTES = 1 << 20  # the default window: sizes up to it take the Lamport path


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("nbytes", [16, 4096, 65536, LAMPORT_BYTES, LAMPORT_BYTES + 16, 8 << 20])
def test_all_reduce_matches_float64_reference_on_every_rank(dtype_name, nbytes):
  with fresh_communicator(poison_outputs=True, lamport_bytes=LAMPORT_BYTES):
    _check_values(nbytes, dtype_name)


@pytest.mark.parametrize("nbytes", [16, 4096, 65536])
def test_barrier_path_is_right_for_small_payloads_too(nbytes):
  with fresh_communicator(poison_outputs=True, lamport_bytes=0) as comm:
    _check_values(nbytes, "bfloat16", calls=5)
    assert comm.stats("values", jax.devices("gpu")[0])["lamport_bytes"] == 0


def test_nan_payloads_whose_bits_are_the_lamport_empty_word_do_not_hang():
  mesh = _mesh()
  fn = _per_rank_all_reduce(mesh)
  rng = np.random.default_rng(3)
  shards = random_shards(rng, N, 4096, np.float32)
  bits = shards.view(np.uint32)
  bits[0, ::7] = 0xFFFFFFFF  # the "empty" pattern, a NaN
  with fresh_communicator(poison_outputs=True, timeout_s=5.0), b12x_jax.channel("values"):
    out = np.asarray(fn(jax.device_put(shards.reshape(-1), NamedSharding(mesh, P("x"))))).reshape(N, -1)
    b12x_jax.check_errors()
  nan = np.zeros(4096, bool)
  nan[::7] = True
  assert np.isnan(out[:, nan]).all()
  assert_sum_matches(out[:, ~nan], shards[:, ~nan], "float32")


def test_peer_probe_reports_a_pair_that_does_not_work():
  ordinals = [d.local_hardware_id for d in jax.devices("gpu")[:N]]
  assert _b12x.probe_peer_access(ordinals) == ""
  problem = _b12x.probe_peer_access([ordinals[0], 1000])
  assert problem and "1000" in problem, problem


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


@pytest.mark.parametrize("lamport_bytes, algorithm", [(1 << 20, "auto"), (0, "one_shot"), (0, "two_shot"),
                                                     (0, "one_shot_pull")],
                         ids=["lamport", "one_shot", "two_shot", "pull"])
def test_a_peer_that_never_joins_raises_the_timeout_error_and_leaves_nan(lamport_bytes, algorithm):
  result = run_worker("timeout", "--platform", "gpu", "--timeout", "1.0", f"--lamport-bytes={lamport_bytes}",
                      f"--algorithm={algorithm}", hard_timeout=120)
  assert len(result["messages"]) == 2, result
  assert result["nan_outputs"] == [True], result  # the timed-out kernel's output, never a stale number
  for message in result["messages"]:
    assert "channel 'lonely'" in message and "rank 0" in message and "rank 1" in message
    assert "epoch" in message
  assert result["seconds"] < 60


def test_a_failed_peer_probe_lowers_to_psum_or_raises_under_strict(monkeypatch):
  # The native probe's verdict reaches Python as a TransportError from preparation: simulate it for
  # this group, the rest of the path (fallback decision, psum lowering, strict error) is the real one.
  from b12x_jax import _native

  def failing_prepare(platform, channel, partition, ordinals, options):
    raise b12x_jax.TransportError(f"peer access between devices {ordinals} does not work: simulated")

  mesh = _mesh()
  shards = random_shards(np.random.default_rng(8), N, 4096, np.float32)
  with fresh_communicator() as comm:
    monkeypatch.setattr(_native, "prepare", failing_prepare)
    with b12x_jax.channel("probe-failed"):
      out = _per_rank_all_reduce(mesh)(jax.device_put(shards.reshape(-1), NamedSharding(mesh, P("x"))))
      assert_sum_matches(np.asarray(out).reshape(N, -1), shards, "float32", roundings=N)
    assert comm.decisions[-1].path == "psum" and "simulated" in comm.decisions[-1].reason
    comm.policy = "strict"
    with b12x_jax.channel("probe-failed-strict"), pytest.raises(b12x_jax.TransportError, match="simulated"):
      _per_rank_all_reduce(mesh)(jax.device_put(shards.reshape(-1), NamedSharding(mesh, P("x"))))
  monkeypatch.undo()
  _check_values(4096, "float32")  # a new communicator probes again, and the real probe passes


def test_close_with_calls_still_queued_on_gpus_waits_for_every_one_of_them():
  result = run_worker("close_pending", "--platform", "gpu", "--runs", "200", hard_timeout=300)
  assert result["right"] == 200 and result["failed"] == 0 and result["prepared"] == [], result


@pytest.mark.parametrize("lamport_bytes, algorithm", [(1 << 20, "auto"), (0, "one_shot"), (0, "two_shot"),
                                                     (0, "one_shot_pull")],
                         ids=["lamport", "one_shot", "two_shot", "pull"])
def test_ranks_at_different_calls_on_one_channel_leave_nan_and_name_both_calls(lamport_bytes, algorithm):
  result = run_worker("mismatch", "--platform", "gpu", "--timeout", "5.0", "--lamport-bytes", str(lamport_bytes),
                      "--algorithm", algorithm, hard_timeout=120)
  assert result["finite"] is False, result  # the kernels' outputs are NaN, never a sum of mixed data
  assert result["seconds"] < 5, result
  how = "lamport" if lamport_bytes else algorithm  # rank 0 at an all_reduce of 64 floats, rank 1 at one of 128
  assert_names_both_calls(result["messages"], {0: rf"all_reduce of 256 bytes \(float32, {how}, grid \d+\)",
                                               1: rf"all_reduce of 512 bytes \(float32, {how}, grid \d+\)"})


@pytest.mark.parametrize("algorithm", ["two_shot", "one_shot_pull"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("nbytes", [LAMPORT_BYTES + 16, (2 << 20) + 48, 8 << 20, 32 << 20])
def test_two_shot_and_pull_match_float64_reference_on_every_rank(algorithm, dtype_name, nbytes):
  with fresh_communicator(poison_outputs=True, algorithm=algorithm, capacity_bytes=32 << 20) as comm:
    _check_values(nbytes, dtype_name)
    assert algorithm in comm.decisions[-1].reason


def test_lamport_one_shot_two_shot_and_pull_calls_interleave_on_one_channel():
  # One executable per algorithm setting, alternated on one channel: the four kernels share its
  # counters and staging slots (two-shot takes two epochs per call).
  mesh = _mesh()
  rng = np.random.default_rng(21)
  sizes = [4096, (1 << 20) + 4096, 3 << 20]  # elements of float32: Lamport, then above the window
  fns = {}
  with fresh_communicator(poison_outputs=True, capacity_bytes=16 << 20, algorithm="one_shot") as comm:
    specs = (P("x"),) * len(sizes)
    with b12x_jax.channel("mixed-algorithms"):
      for algorithm in ("one_shot", "two_shot", "one_shot_pull"):
        comm.algorithm = algorithm  # traced under each setting: two executables on one channel

        def body(*xs):  # a new function each time: no tracing-cache hit across the settings
          return tuple(b12x_jax.all_reduce(x, "x") for x in xs)
        fns[algorithm] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs)).lower(
            *[jax.ShapeDtypeStruct((N * s,), np.float32, sharding=NamedSharding(mesh, P("x"))) for s in sizes]
        ).compile()
      for i in range(60):
        shards = [random_shards(rng, N, s, np.float32) for s in sizes]
        outs = fns[("one_shot", "two_shot", "one_shot_pull")[i % 3]](
            *[jax.device_put(s.reshape(-1), NamedSharding(mesh, P("x"))) for s in shards])
        for s, out in zip(shards, outs):
          assert_sum_matches(np.asarray(out).reshape(N, -1), s, "float32")
    b12x_jax.check_errors()
