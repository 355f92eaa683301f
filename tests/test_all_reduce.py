"""all_reduce on the CPU backend (emulated host devices): values against a
float64 reference, channel isolation, the psum fallback, errors."""

from __future__ import annotations

import re
import time

import jax
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import b12x_jax
from b12x_jax.errors import GroupUnreachableError
from conftest import run_worker
from helpers import (ALGORITHM_SIZES, DTYPES, assert_names_both_calls, assert_sum_matches, check_every_protocol,
                     fresh_communicator, random_shards)


def _per_rank(mesh, **kwargs):
  return jax.jit(jax.shard_map(lambda x: b12x_jax.all_reduce(x, "x", **kwargs), mesh=mesh, in_specs=P("x"),
                               out_specs=P("x")))


def _run(fn, mesh, shards):
  return np.asarray(fn(jax.device_put(shards.reshape(-1), NamedSharding(mesh, P("x"))))).reshape(shards.shape)


CAPACITY = 8 << 20


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("nbytes", [16, 4096, 1 << 20, CAPACITY, 2 * CAPACITY])
def test_all_reduce_matches_float64_reference(cpu_mesh, n, dtype_name, nbytes):
  dtype = DTYPES[dtype_name]
  mesh = cpu_mesh(n)
  fn = _per_rank(mesh)
  rng = np.random.default_rng([n, nbytes])
  with fresh_communicator(poison_outputs=True) as comm, b12x_jax.channel(f"values{n}"):
    for _ in range(2):  # fresh inputs each call, both staging slots
      shards = random_shards(rng, n, nbytes // np.dtype(dtype).itemsize, dtype)
      assert_sum_matches(_run(fn, mesh, shards), shards, dtype_name, roundings=1 if nbytes <= CAPACITY else n)
  decision = comm.decisions[-1]
  assert decision.path == ("b12x" if nbytes <= CAPACITY else "psum"), decision


@pytest.mark.parametrize("lamport_bytes", [1 << 20, 0], ids=["lamport", "barrier"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_every_rank_holds_the_same_bits_where_an_input_holds_the_lamport_empty_word(cpu_mesh, lamport_bytes,
                                                                                     dtype_name):
  # All ones is a NaN in every dtype and the Lamport exchange's empty word: the wire carries another NaN
  # (ffi/lamport.h), so the rank that sent it must sum that NaN too, or its bits differ from its peers' (C9).
  dtype = DTYPES[dtype_name]
  mesh, n = cpu_mesh(2), 2
  shards = random_shards(np.random.default_rng(21), n, 1024, dtype)
  bits = shards.view(np.uint32 if np.dtype(dtype).itemsize == 4 else np.uint16)
  bits[0, :8] = np.iinfo(bits.dtype).max  # rank 0 alone
  bits[:, 8:16] = np.iinfo(bits.dtype).max  # both ranks
  with fresh_communicator(lamport_bytes=lamport_bytes), b12x_jax.channel("empty-word"):
    out = _run(_per_rank(mesh), mesh, shards)
    assert b12x_jax.get_communicator().decisions[-1].path == "b12x"
  out_bits = out.view(bits.dtype)
  assert np.array_equal(out_bits[0], out_bits[1]), (out_bits[:, :16], dtype_name)
  assert np.isnan(out[:, :16].astype(np.float32)).all() and not np.isnan(out[:, 16:].astype(np.float32)).any()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot", "one_shot_pull"])
def test_every_protocol_matches_float64_inside_and_outside_the_lamport_window(cpu_mesh, n, algorithm):
  # The host runs what CUDA runs (ffi/all_reduce.h plan_for): Lamport within the window, the algorithm asked
  # for above it.
  assert check_every_protocol(cpu_mesh(n), algorithm, seed=n) == len(ALGORITHM_SIZES) * len(DTYPES) * 2


@pytest.mark.parametrize("n", [5, 6, 7, 8])
def test_every_protocol_matches_float64_on_five_to_eight_ranks(n):
  # Up to the largest group a channel serves, on emulated CPU devices in a worker (this process has 4).
  result = run_worker("protocols", "--platform", "cpu", "--devices", str(n), hard_timeout=300)
  assert result["checked"] == 3 * len(ALGORITHM_SIZES) * len(DTYPES) * 2, result


def test_a_call_that_waits_seconds_for_a_late_rank_does_not_hold_a_core(cpu_mesh):
  # Rank 1 reaches the call 2 s after rank 0 (a host callback sleeps first): the progress thread spins a
  # millisecond, then naps (it yielded the whole wait: 1.8 s of CPU in 2 s).
  mesh = cpu_mesh(2)
  late = lambda v: io_callback(lambda a: (time.sleep(2.0), a)[1], jax.ShapeDtypeStruct(v.shape, v.dtype), v)  # noqa: E731
  body = lambda v: b12x_jax.all_reduce(jax.lax.cond(jax.lax.axis_index("x") == 1, late, lambda u: u + 0, v), "x")  # noqa: E731
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  shards = random_shards(np.random.default_rng(4), 2, 256, np.float32)
  with fresh_communicator(timeout_s=30.0), b12x_jax.channel("late-rank"):
    assert_sum_matches(_run(fn, mesh, shards), shards, "float32")  # compiled and prepared
    shards = random_shards(np.random.default_rng(5), 2, 256, np.float32)
    wall, cpu = time.monotonic(), time.process_time()
    out = _run(fn, mesh, shards)
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
  assert_sum_matches(out, shards, "float32")
  assert wall > 1.9 and cpu < 0.5 * wall, (wall, cpu)


def test_two_shot_meets_twice_per_call(cpu_mesh):
  mesh = cpu_mesh(2)
  with fresh_communicator(algorithm="two_shot", lamport_bytes=0) as comm, b12x_jax.channel("two-shot"):
    shards = random_shards(np.random.default_rng(8), 2, 1000, np.float32)
    assert_sum_matches(_run(_per_rank(mesh), mesh, shards), shards, "float32")
    assert comm.stats("two-shot", mesh.devices.flat[0])["epoch"] == 2


def test_the_decision_names_the_lamport_exchange_within_its_window_whatever_the_algorithm(cpu_mesh):
  # Communicator(algorithm=...) applies above the window (ffi/all_reduce.h plan_for): the reason says what ran.
  mesh = cpu_mesh(2)
  with fresh_communicator(algorithm="two_shot", lamport_bytes=4096) as comm, b12x_jax.channel("named-path"):
    device = mesh.devices.flat[0]
    for floats, reason, meetings in [(1024, "within the Lamport window", 1), (2048, "two_shot (Communicator", 2)]:
      shards = random_shards(np.random.default_rng(floats), 2, floats, np.float32)
      before = comm.stats("named-path", device)["epoch"] if floats > 1024 else 0
      assert_sum_matches(_run(_per_rank(mesh), mesh, shards), shards, "float32")
      decision = comm.decisions[-1]
      assert decision.path == "b12x" and reason in decision.reason, (floats, decision)
      assert comm.stats("named-path", device)["epoch"] - before == meetings, floats  # two-shot meets twice a call


@pytest.mark.parametrize("lamport_bytes, algorithm", [(1 << 20, "auto"), (0, "one_shot"), (0, "two_shot"),
                                                     (0, "one_shot_pull")],
                         ids=["lamport", "one_shot", "two_shot", "pull"])
def test_ranks_at_different_calls_on_one_channel_raise_a_clear_error(lamport_bytes, algorithm):
  # Rank 0 reduces 64 floats and rank 1 128 on one channel: the call tag (docs/DESIGN.md) stops both with
  # an error naming both calls, never a sum of mixed data, never a hang.
  result = run_worker("mismatch", "--platform", "cpu", "--timeout", "5.0", "--lamport-bytes", str(lamport_bytes),
                      "--algorithm", algorithm, hard_timeout=120)
  assert result["finite"] is None, result  # on CPU the call itself raises
  assert result["seconds"] < 5, result  # found at the first look, not by a timeout
  how = "lamport" if lamport_bytes else algorithm  # rank 0 at an all_reduce of 64 floats, rank 1 at one of 128
  assert_names_both_calls(result["messages"], {0: f"all_reduce of 256 bytes \\(float32, {how}, grid 1\\)",
                                               1: f"all_reduce of 512 bytes \\(float32, {how}, grid 1\\)"})


@pytest.mark.parametrize("lamport_bytes", [1 << 20, 0], ids=["lamport", "barrier"])
def test_a_peer_that_never_joins_times_out_with_names_on_either_protocol(lamport_bytes):
  result = run_worker("timeout", "--platform", "cpu", "--timeout", "1.0", "--lamport-bytes", str(lamport_bytes),
                      hard_timeout=120)
  assert len(result["messages"]) == 2 and result["nan_outputs"] == [], result  # on CPU the call itself raises
  for message in result["messages"]:
    assert re.search(r"channel 'lonely' rank 0 timed out after 1 s at epoch 1 waiting for rank 1", message), message
    assert "raise timeout_s if the peer is only slow" in message, message  # one process: its first call's bound too
    assert "on CPU devices block on each execution's results before the next" in message, message
  assert result["seconds"] < 30


def test_invariant_output_can_leave_shard_map_replicated(cpu_mesh):
  mesh = cpu_mesh(2)
  fn = jax.jit(jax.shard_map(lambda x: b12x_jax.all_reduce(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
  shards = random_shards(np.random.default_rng(1), 2, 64, np.float32)
  out = np.asarray(fn(jax.device_put(shards.reshape(-1), NamedSharding(mesh, P("x")))))
  np.testing.assert_allclose(out, shards.astype(np.float64).sum(0), rtol=1e-6)


def test_two_dimensional_mesh_reduces_within_each_group():
  mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices("cpu")[:4])
  fn = jax.jit(jax.shard_map(lambda x: b12x_jax.all_reduce(x, "tp", channel="tp2d"), mesh=mesh,
                             in_specs=P(("dp", "tp")), out_specs=P(("dp", "tp"))))
  shards = random_shards(np.random.default_rng(2), 4, 32, np.float32)
  out = np.asarray(fn(jax.device_put(shards.reshape(-1), NamedSharding(mesh, P(("dp", "tp")))))).reshape(4, 32)
  for group in ([0, 1], [2, 3]):
    for r in group:
      np.testing.assert_allclose(out[r], shards[group].astype(np.float64).sum(0), rtol=1e-6)


def test_target_and_draft_advance_separate_counters(cpu_mesh):
  mesh = cpu_mesh(2)
  fn = _per_rank(mesh)
  comm = b12x_jax.get_communicator()
  rng = np.random.default_rng(3)
  calls = {"iso-target": 0, "iso-draft": 0}
  for name in ["iso-target", "iso-draft", "iso-target", "iso-target", "iso-draft"]:
    shards = random_shards(rng, 2, 128, np.float32)
    with b12x_jax.channel(name):
      assert_sum_matches(_run(fn, mesh, shards), shards, "float32")
    calls[name] += 1
    for channel, count in calls.items():
      if count == 0:
        continue
      for device in mesh.devices.flat:
        assert comm.stats(channel, device)["epoch"] == count


def test_unknown_axis_is_a_clear_error(cpu_mesh):
  mesh = cpu_mesh(2)
  fn = jax.jit(jax.shard_map(lambda x: b12x_jax.all_reduce(x, "y"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  with pytest.raises(ValueError, match=r"b12x_jax.all_reduce: unknown axis_name 'y'.*shard_map"):
    fn(jax.device_put(np.ones(4, np.float32), NamedSharding(mesh, P("x"))))


def test_misaligned_size_under_strict_policy_is_a_clear_error(cpu_mesh):
  mesh = cpu_mesh(2)
  comm = b12x_jax.get_communicator()
  comm.policy = "strict"
  try:
    fn = _per_rank(mesh)
    with pytest.raises(b12x_jax.IneligibleError, match=r"all_reduce: payload of 12 bytes is not a multiple of 16"):
      fn(jax.device_put(np.ones(6, np.float32), NamedSharding(mesh, P("x"))))
  finally:
    comm.policy = "auto"


def test_misaligned_size_under_auto_policy_falls_back_to_psum(cpu_mesh):
  mesh = cpu_mesh(2)
  shards = random_shards(np.random.default_rng(4), 2, 3, np.float32)
  with b12x_jax.channel("fallback"):
    assert_sum_matches(_run(_per_rank(mesh), mesh, shards), shards, "float32")
  decision = b12x_jax.get_communicator().decisions[-1]
  assert decision.path == "psum" and "not a multiple of 16" in decision.reason


def test_integer_dtype_falls_back_to_psum(cpu_mesh):
  mesh = cpu_mesh(2)
  shards = np.arange(16, dtype=np.int32).reshape(2, 8)
  out = _run(_per_rank(mesh), mesh, shards)
  assert (out == shards.sum(0)).all()
  assert "dtype int32" in b12x_jax.get_communicator().decisions[-1].reason


def test_released_channel_can_be_prepared_again(cpu_mesh):
  mesh = cpu_mesh(2)
  fn = _per_rank(mesh)
  comm = b12x_jax.get_communicator()
  shards = random_shards(np.random.default_rng(5), 2, 64, np.float32)
  with b12x_jax.channel("throwaway"):
    _run(fn, mesh, shards)
    key = comm.cache_key()
    assert comm.release("throwawy") is False and comm.cache_key() == key  # a typo releases nothing, retraces nothing
    with pytest.raises(b12x_jax.ChannelError, match=r"Communicator.release: channel name must be"):
      comm.release("not a name!")
    assert "throwaway" in comm.prepared_channels()
    assert comm.release("throwaway") is True
    assert "throwaway" not in comm.prepared_channels()
    comm.prepare(mesh, "x", channels=["throwaway"])
    assert_sum_matches(_run(fn, mesh, shards), shards, "float32")
  assert comm.stats("throwaway", mesh.devices.flat[0])["epoch"] == 1


def test_communicator_rejects_bad_settings():
  with pytest.raises(ValueError, match="capacity_bytes must be a positive multiple of 16"):
    b12x_jax.Communicator(capacity_bytes=100)
  with pytest.raises(ValueError, match="policy must be one of"):
    b12x_jax.Communicator(policy="fast")
  with pytest.raises(ValueError, match="timeout_s must be a number of seconds > 0"):
    b12x_jax.Communicator(timeout_s=0)
  with pytest.raises(ValueError, match="lamport_bytes must be a non-negative multiple of 16"):
    b12x_jax.Communicator(lamport_bytes=-16)


def test_poisoned_outputs_are_fully_overwritten(cpu_mesh):
  # poison_outputs fills every output with NaN before the backend writes it:
  # a NaN left over would fail assert_sum_matches.
  with fresh_communicator(poison_outputs=True) as comm:
    mesh = cpu_mesh(2)
    fn = _per_rank(mesh)
    rng = np.random.default_rng(11)
    with b12x_jax.channel("poisoned"):
      for nbytes in (16, 4096, 1 << 16):
        shards = random_shards(rng, 2, nbytes // 4, np.float32)
        assert_sum_matches(_run(fn, mesh, shards), shards, "float32")
    assert comm.stats("poisoned", mesh.devices.flat[0])["lamport_bytes"] == 1 << 20  # the host runs Lamport too


def test_close_twice_is_harmless(cpu_mesh):
  comm = b12x_jax.Communicator()
  comm.prepare(cpu_mesh(2), "x", channels=["closing"])
  comm.close()
  comm.close()
  assert comm.closed and not comm.prepared_channels()


def test_a_group_whose_transport_fails_lowers_to_psum_or_raises_under_strict(cpu_mesh, monkeypatch):
  # The lowering-time fallback shared by CPU and CUDA (a failed P2P probe on GPUs), reached on CPU by
  # making preparation fail the way the probe does.
  from b12x_jax import _native

  def failing_prepare(platform, channel, partition, ordinals, options):
    raise GroupUnreachableError(f"peer access between devices {ordinals} does not work: simulated")

  comm = b12x_jax.get_communicator()
  monkeypatch.setattr(_native, "prepare", failing_prepare)
  monkeypatch.setattr(comm, "_broken", {})  # the failure is remembered per group: forget it afterwards
  mesh = cpu_mesh(2)
  shards = random_shards(np.random.default_rng(6), 2, 64, np.float32)
  with b12x_jax.channel("broken-transport"):
    fn = _per_rank(mesh)
    text = fn.lower(jax.device_put(shards.reshape(-1), NamedSharding(mesh, P("x")))).as_text()
    assert "b12x_all_reduce" not in text and "all_reduce" in text
    assert_sum_matches(_run(fn, mesh, shards), shards, "float32")
  decision = comm.decisions[-1]
  assert decision.path == "psum" and "simulated" in decision.reason
  comm.policy = "strict"
  try:
    with b12x_jax.channel("broken-transport-strict"):
      with pytest.raises(b12x_jax.TransportError, match=r"all_reduce: .*simulated \(policy 'strict'"):
        _per_rank(mesh)(jax.device_put(shards.reshape(-1), NamedSharding(mesh, P("x"))))
  finally:
    comm.policy = "auto"


def test_a_channel_whose_memory_fails_falls_back_alone_and_is_prepared_again_later(cpu_mesh, monkeypatch):
  # A failed allocation is the channel's, not its devices': the group's other channels keep b12x, and the
  # channel's next lowering prepares it again (a failed probe, above, is remembered for the group).
  from b12x_jax import _native

  prepare = _native.prepare

  def out_of_memory(platform, channel, partition, ordinals, options):
    if channel == "no-memory":
      raise b12x_jax.TransportError("b12x_jax: preparing channel 'no-memory' failed: out of memory (simulated)")
    return prepare(platform, channel, partition, ordinals, options)

  mesh = cpu_mesh(2)
  shards = random_shards(np.random.default_rng(16), 2, 64, np.float32)
  with fresh_communicator() as comm:
    monkeypatch.setattr(_native, "prepare", out_of_memory)
    for channel, path in [("has-memory", "b12x"), ("no-memory", "psum"), ("has-memory-too", "b12x")]:
      with b12x_jax.channel(channel):
        assert_sum_matches(_run(_per_rank(mesh), mesh, shards), shards, "float32")
      assert (comm.decisions[-1].channel, comm.decisions[-1].path) == (channel, path), comm.decisions[-1]
    assert "out of memory (simulated)" in comm.decisions[-2].reason
    monkeypatch.setattr(_native, "prepare", prepare)
    with b12x_jax.channel("no-memory"):
      assert_sum_matches(_run(_per_rank(mesh), mesh, shards), shards, "float32")
    assert (comm.decisions[-1].channel, comm.decisions[-1].path) == ("no-memory", "b12x"), comm.decisions[-1]


def test_the_environment_switch_forces_the_psum_path(cpu_mesh, monkeypatch):
  monkeypatch.setenv("B12X_JAX_POLICY", "psum")
  mesh = cpu_mesh(2)
  shards = random_shards(np.random.default_rng(12), 2, 64, np.float32)
  with fresh_communicator() as comm, b12x_jax.channel("switched-off"):
    assert comm.policy == "psum"
    fn = _per_rank(mesh)
    assert "b12x_all_reduce" not in fn.lower(jax.device_put(shards.reshape(-1), NamedSharding(mesh, P("x")))).as_text()
    assert_sum_matches(_run(fn, mesh, shards), shards, "float32", roundings=2)
    assert comm.decisions[-1].path == "psum" and "policy 'psum'" in comm.decisions[-1].reason
    monkeypatch.delenv("B12X_JAX_POLICY")  # before fresh_communicator's exit makes the next default one
  monkeypatch.setenv("B12X_JAX_POLICY", "")  # `export B12X_JAX_POLICY=`: unset, not an error
  assert b12x_jax.Communicator().policy == "auto"
  monkeypatch.setenv("B12X_JAX_POLICY", "strict")  # its error says how to leave it: the variable, not policy=
  with fresh_communicator() as comm, b12x_jax.channel("switched-strict"):
    assert comm.policy == "strict"
    with pytest.raises(b12x_jax.IneligibleError, match=r"dtype int32.* or use B12X_JAX_POLICY=auto \(it set "
                                                       r"'strict' here\) to fall back to psum"):
      _per_rank(mesh)(jax.device_put(shards.reshape(-1).astype(np.int32), NamedSharding(mesh, P("x"))))
    monkeypatch.delenv("B12X_JAX_POLICY")
  monkeypatch.setenv("B12X_JAX_POLICY", "fast")
  with pytest.raises(ValueError, match=r"Communicator: environment variable B12X_JAX_POLICY must be one of"):
    b12x_jax.Communicator()


def test_close_with_calls_still_queued_waits_for_every_one_of_them():
  result = run_worker("close_pending", "--runs", "40")
  assert result["right"] == 40 and result["failed"] == 0 and result["prepared"] == [], result
