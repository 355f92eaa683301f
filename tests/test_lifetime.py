"""Channel memory outlives every executable that points at it (DESIGN C16).

release() takes a channel out of use but never frees its memory: a cached
executable (on CUDA, a CUDA graph replayed without its handler) may still
point at it. Preparing the same group with the same settings reuses it,
reset; a cached executable run in between raises "not prepared".
tests/test_multiprocess.py runs the same across processes, and the GPU rig
under compute-sanitizer.
"""

from __future__ import annotations

import os
import gc
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import WORKERS
from helpers import (assert_sum_matches, check_a_failed_call_leaves_later_calls_right, fresh_communicator,
                     put_sharded, random_shards)
from jax.sharding import PartitionSpec as P

import b12x_jax
from b12x_jax import _native


def check_compiled_across_release_and_prepare(mesh, elems: int) -> None:
  """A compiled executable of ``elems`` floats per rank on ``mesh`` (2
  devices), run, its channel released and prepared again, three times: on
  the kept memory, reset at each preparation (on CUDA the graph replays the
  pointers it captured); between a release and the next prepare it raises
  "not prepared". Shared with tests/gpu/test_lifetime_gpu.py."""
  rng = np.random.default_rng(11)
  with fresh_communicator(poison_outputs=True) as comm:
    fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with b12x_jax.channel("reused"):
      compiled = fn.lower(put_sharded(mesh, random_shards(rng, 2, elems, np.float32))).compile()
      for cycle in range(3):
        for _ in range(2):
          shards = random_shards(rng, 2, elems, np.float32)
          assert_sum_matches(np.asarray(compiled(put_sharded(mesh, shards))).reshape(2, -1), shards, "float32")
        assert comm.stats("reused", mesh.devices[0])["epoch"] == 2  # reset at every preparation
        comm.release("reused")
        with pytest.raises(Exception, match="channel 'reused' is not prepared on device"):
          np.asarray(compiled(put_sharded(mesh, shards)))
        comm.prepare(mesh, "x", channels=["reused"])


def _late_on_rank_1(mesh, seconds: float):
  """A compiled all_reduce of 256 floats per rank whose execution reaches
  its call about ``seconds`` later on rank 1 than on rank 0: rank 1 first
  spins through steps that add exactly 0 to its input, as many as take that
  long here (timed by one call, on the prepared channel of the scope). (A host callback would be simpler, but JAX keeps a runtime
  token of every execution with one, and the failed ones' tokens raise in
  later tests' effects_barrier.) Returns run(shards)."""
  def body(v, spins):
    steps = jax.lax.axis_index("x") * spins[0]
    spun = jax.lax.fori_loop(0, steps, lambda i, a: jnp.sin(a) + 1.0, jnp.zeros((), v.dtype))
    return b12x_jax.all_reduce(v + jnp.where(spun > 1e9, 1.0, 0.0).astype(v.dtype), "x")  # spun <= 2
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
  zeros = np.zeros((2, 256), np.float32)
  compiled = fn.lower(put_sharded(mesh, zeros), np.zeros(1, np.int32)).compile()
  started, spins = time.monotonic(), 10**6
  np.asarray(compiled(put_sharded(mesh, zeros), np.array([spins], np.int32)))
  spins = np.array([min(spins * seconds / (time.monotonic() - started), 2**31 - 1)], np.int32)
  return lambda shards: compiled(put_sharded(mesh, shards), spins)


def _raise_unprepared_and_drop(run, shards) -> str:
  """Runs on an unprepared channel and reads rank 0's result, which raises
  at once (np.asarray of the whole result waits for every shard on jax
  0.12). The results are dropped unread on rank 1, so no Python object
  waits for it."""
  try:
    np.asarray(run(shards).addressable_shards[0].data)
  except Exception as e:  # noqa: BLE001 - the message is what the caller checks
    return str(e)
  return "no error"


def _record_refusal_polls(monkeypatch) -> list[bool]:
  """The evenness of every poll of the refusal counts a preparation makes
  (ffi/registry.h refusals), in order."""
  polls = []
  count = _native._b12x.refusals

  def recorded(*args):
    even, calls = count(*args)
    polls.append(even)
    return even, calls

  monkeypatch.setattr(_native._b12x, "refusals", recorded)
  return polls


def test_a_preparation_waits_for_a_refused_calls_execution_still_on_its_way_to_a_device(cpu_mesh, monkeypatch):
  # Rank 0's call raised "not prepared" while rank 1's execution of it was still about 0.5 s short
  # of its call, its results dropped. Prepared at once, the channel let that execution meet rank
  # 0's next call (a sum of one new and one old shard) or hold a thread until it timed out (seen
  # on 2 CPU cores). The preparation now waits until rank 1 refused it too.
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(15)
  polls = _record_refusal_polls(monkeypatch)
  with fresh_communicator(poison_outputs=True) as comm, b12x_jax.channel("late-refusal"):
    run = _late_on_rank_1(mesh, 0.5)
    for cycle in range(2):
      comm.release("late-refusal")
      assert "is not prepared on device 0" in _raise_unprepared_and_drop(run, random_shards(rng, 2, 256, np.float32))
      gc.collect()
      polls.clear()
      comm.prepare(mesh, "x", channels=["late-refusal"])
      # Rank 1 was still short of its call (else this test checks nothing): the preparation found
      # the counts uneven, then waited until they were even.
      assert polls[0] is False and polls[-1] is True, polls[:3]
      for _ in range(3):
        shards = random_shards(rng, 2, 256, np.float32)
        assert_sum_matches(np.asarray(run(shards)).reshape(2, -1), shards, "float32")


def test_a_preparation_names_the_devices_a_refused_calls_execution_has_not_reached_within_the_timeout(cpu_mesh):
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(16)
  with fresh_communicator(timeout_s=0.3) as comm, b12x_jax.channel("later-refusal"):
    run = _late_on_rank_1(mesh, 2.0)
    comm.release("later-refusal")
    _raise_unprepared_and_drop(run, random_shards(rng, 2, 256, np.float32))
    gc.collect()
    started = time.monotonic()
    with pytest.raises(b12x_jax.CollectiveTimeoutError,
                       match=r"b12x_jax.Communicator.prepare: channel 'later-refusal': a call refused as not "
                             r"prepared on some of its devices had not reached devices \[1\] after 0.3 s \(refused "
                             r"calls: device 0: 1, device 1: 0\).*Block on every shard"):
      comm.prepare(mesh, "x", channels=["later-refusal"])
    assert time.monotonic() - started < 1.5
    time.sleep(3)  # rank 1's execution reaches its call and is refused
    # As the error says, preparing again goes ahead (counts the call reached rank 1, or never would).
    comm.prepare(mesh, "x", channels=["later-refusal"])
    fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    shards = random_shards(rng, 2, 256, np.float32)
    assert_sum_matches(np.asarray(fn(put_sharded(mesh, shards))).reshape(2, -1), shards, "float32")


def test_a_failed_execution_leaves_later_calls_right_and_reports_nothing_more(cpu_mesh):
  check_a_failed_call_leaves_later_calls_right(cpu_mesh(2), 1024)


def _resident_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_100_throwaway_channels_of_new_names_reuse_the_memory_of_the_first(cpu_mesh):
  # A channel of the default 8 MiB capacity holds 2 x 2 x 8 MiB of staging and 3 x 2 x 1 MiB of Lamport
  # buffers per rank: 76 MiB for 2 ranks. Each new name reuses (renamed) what the last release left.
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(14)
  with fresh_communicator() as comm:
    fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    resident = []
    for cycle in range(100):
      with comm.throwaway(f"scratch-{cycle}"):
        shards = random_shards(rng, 2, 256, np.float32)
        assert_sum_matches(np.asarray(fn(put_sharded(mesh, shards))).reshape(2, -1), shards, "float32")
      resident.append(_resident_bytes())
  assert resident[-1] - resident[1] < 38 << 20, [r >> 20 for r in resident[::10]]  # less than half a channel


def test_a_compiled_executable_raises_not_prepared_after_release_and_is_right_once_prepared_again(cpu_mesh):
  check_compiled_across_release_and_prepare(cpu_mesh(2), 1024)


def test_a_process_that_exits_with_calls_in_flight_ends_cleanly():
  for _ in range(5):  # the abort it prevents was intermittent
    proc = subprocess.run([sys.executable, WORKERS, "exit_busy", "--devices", "4", "--runs", "100"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "RESULT" in proc.stdout, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-2000:]


def test_a_jitted_function_prepares_its_channel_again_by_itself_after_a_release(cpu_mesh):
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(12)
  traces = []
  with fresh_communicator(poison_outputs=True) as comm:
    def body(v):
      traces.append(1)
      return b12x_jax.all_reduce(v, "x")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with b12x_jax.channel("again"):
      for cycle in range(3):
        shards = random_shards(rng, 2, 1024, np.float32)
        assert_sum_matches(np.asarray(fn(put_sharded(mesh, shards))).reshape(2, -1), shards, "float32")
        comm.release("again")  # no prepare(): the next call traces again and prepares
    assert len(traces) == 3 and "again" not in comm.prepared_channels()


def test_the_first_function_of_a_process_is_traced_once():
  code = ("import os; os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'\n"
          "import jax, numpy as np, b12x_jax\n"
          "from jax.sharding import PartitionSpec as P, NamedSharding\n"
          "mesh = jax.make_mesh((2,), ('x',)); traces = []\n"
          "def body(v):\n  traces.append(1); return b12x_jax.all_reduce(v, 'x')\n"
          "fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P('x'), out_specs=P('x')))\n"
          "x = jax.device_put(np.ones(2 * 256, np.float32), NamedSharding(mesh, P('x')))\n"
          "fn(x).block_until_ready(); fn(x).block_until_ready()\n"
          "print('TRACES', len(traces), fn._cache_size())\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
  assert "TRACES 1 1" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_a_communicator_dropped_without_close_leaves_its_channels_to_the_next(cpu_mesh):
  # One made and prepared but never installed, then dropped: every later preparation of its channel,
  # by any Communicator, raised "already prepared ... by another Communicator: close() the other one
  # first", which nothing could do any more.
  import gc
  mesh = cpu_mesh(2)
  dropped = b12x_jax.Communicator()
  dropped.prepare(mesh, "x", channels=["dropped"])
  del dropped
  gc.collect()
  with fresh_communicator() as comm, b12x_jax.channel("dropped"):
    fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
    shards = random_shards(np.random.default_rng(14), 2, 64, np.float32)
    assert_sum_matches(np.asarray(fn(put_sharded(mesh, shards)))[None], shards, "float32")
    assert comm.decisions[-1].path == "b12x" and comm.prepared_channels() == {"dropped": [(0, 1)]}


def test_releasing_a_channel_takes_only_the_communicators_own_groups(cpu_mesh):
  # A release took every group of the channel's name in the process: a dropped Communicator,
  # collected late, took another's group of the same channel on other devices, whose calls then
  # raised "not prepared".
  import gc
  devices = jax.devices("cpu")
  low, high = (jax.sharding.Mesh(np.array(devices[i:i + 2]), ("x",)) for i in (0, 2))
  dropped = b12x_jax.Communicator()
  dropped.prepare(low, "x", channels=["shared_name"])
  dropped.cycle = dropped  # collected only by gc.collect(), after the other prepared
  del dropped
  with fresh_communicator() as comm, b12x_jax.channel("shared_name"):
    comm.prepare(high, "x", channels=["shared_name"])
    gc.collect()
    assert comm.stats("shared_name", devices[2])["world"] == 2
    fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=high, in_specs=P("x"), out_specs=P()))
    shards = random_shards(np.random.default_rng(15), 2, 64, np.float32)
    assert_sum_matches(np.asarray(fn(put_sharded(high, shards)))[None], shards, "float32")
    assert comm.decisions[-1].path == "b12x"
    other = b12x_jax.Communicator()
    other.prepare(low, "x", channels=["shared_name"])  # the dropped one's group was released: free to take
    other.close()  # and its close leaves comm's group in use
    assert_sum_matches(np.asarray(fn(put_sharded(high, shards)))[None], shards, "float32")


def test_a_second_communicator_preparing_a_channel_the_first_holds_names_the_cause(cpu_mesh):
  # It said the device was "in another group of partition ...": the same group, held by another Communicator.
  # Where a released group of the same devices and settings was there to reuse, the second took it, and two
  # live groups served the channel on the same devices.
  mesh = cpu_mesh(2)
  with fresh_communicator() as comm:
    comm.prepare(mesh, "x", channels=["held", "spare"])
    comm.release("spare")  # reusable memory for the other Communicator
    other = b12x_jax.Communicator()
    with pytest.raises(b12x_jax.ChannelError, match=r"channel 'held' is already prepared for devices \[0, 1\] by "
                                                    r"another Communicator of this process: use "
                                                    r"b12x_jax\.get_communicator\(\), or close\(\) the other one"):
      other.prepare(mesh, "x", channels=["held"])
    other.close()


def test_a_wait_for_peers_records_leaves_other_channels_free_to_prepare(cpu_mesh, monkeypatch):
  # exchange_records waits up to setup_timeout_s for other processes' records (a Triton kernel's address
  # table). Meanwhile this process's other threads go on preparing channels: a process held up there
  # would keep its peers waiting for what it would publish next, each until the timeout.
  import threading

  from b12x_jax import _compat, communicator, rendezvous

  entered, go_on = threading.Event(), threading.Event()

  def slow_fetch(preparation, kind, missing, timeout_s):
    entered.set()
    assert go_on.wait(30)
    return {1: b"peer"}

  monkeypatch.setattr(rendezvous, "fetch_records", slow_fetch)
  monkeypatch.setattr(rendezvous, "publish_records", lambda *args: None)
  mesh = cpu_mesh(2)
  group = tuple(mesh.devices.flat)
  partition = communicator.partition_key([group])
  with fresh_communicator() as comm:
    comm._preparations[(_compat.platform_of(group), "waiting", partition, communicator._ordinals(group))] = "prep"
    exchanged, prepared = [], []
    waiter = threading.Thread(target=lambda: exchanged.append(
        comm.exchange_records("waiting", partition, group, "row", {0: b"own"})))
    waiter.start()
    assert entered.wait(30)
    other = threading.Thread(target=lambda: prepared.append(comm.prepare(mesh, "x", channels=["meanwhile"])))
    other.start()
    other.join(20)
    finished_first = not other.is_alive()
    go_on.set()
    waiter.join(30)
    other.join(30)
    assert finished_first and "meanwhile" in comm.prepared_channels()
    assert exchanged == [{0: b"own", 1: b"peer"}]
