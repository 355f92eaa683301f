"""The all-reduce algorithm choice (b12x_jax.tuning): crossovers from
measurements, the stored calibration, and what the lowering emits."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import b12x_jax
from b12x_jax import calibration, tuning
from helpers import assert_sum_matches, fresh_communicator, random_shards

MiB = 1 << 20


def test_crossovers_start_where_the_challenger_wins_at_every_larger_size():
  times = {
      1 * MiB: {"one_shot": 10, "two_shot": 12, "psum": 30},
      2 * MiB: {"one_shot": 20, "two_shot": 19, "psum": 40},  # a win that does not last: noise
      4 * MiB: {"one_shot": 40, "two_shot": 41, "psum": 50},
      8 * MiB: {"one_shot": 80, "two_shot": 70, "psum": 75},
      16 * MiB: {"one_shot": 160, "two_shot": 140, "psum": 130},
  }
  assert calibration.crossovers_from(times) == (8 * MiB, 16 * MiB)
  never = {s: {"one_shot": 1, "two_shot": 2, "psum": 3} for s in (MiB, 2 * MiB)}
  assert calibration.crossovers_from(never) == (None, None)


def test_per_op_us_warms_up_for_its_runs_and_seconds_then_takes_the_median_per_op():
  import time
  spans = []  # (start, end) of every run

  def run():  # 1, 4, 2, 1, 4, 2, ... ms
    start = time.perf_counter()
    time.sleep((1e-3, 4e-3, 2e-3)[len(spans) % 3])
    spans.append((start, time.perf_counter()))
    return np.zeros(1)

  begin = time.perf_counter()
  us = calibration.per_op_us(run, ops=4, iters=5, warmup=2, warmup_s=0.1)
  warm, timed = spans[:-5], spans[-5:]
  # The warm-up ends when the loop finds warmup_s passed, just after its last run recorded its end:
  # the first timed run is what must start at least warmup_s in.
  assert len(warm) >= 2 and timed[0][0] - begin >= 0.1, (len(warm), timed[0][0] - begin)
  assert us == pytest.approx(np.median([end - start for start, end in timed]) / 4 * 1e6, rel=0.2), us


def test_per_op_us_of_several_processes_warms_up_for_its_runs_only(monkeypatch):
  # Rounds counted to fill a time differ between processes, and a collective run more often in one process
  # than in another waits for peers that never come (benchmarks/all_reduce_multiprocess.py failed so).
  runs = []
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  calibration.per_op_us(lambda: runs.append(1) or np.zeros(1), ops=1, iters=3, warmup=4, warmup_s=60.0)
  assert len(runs) == 4 + 3, len(runs)


def test_paired_per_op_us_times_every_run_in_each_round_and_takes_the_median_of_their_differences():
  import time
  order = []  # which run ran, in turn

  def sleeper(name, base_ms):
    def run():
      # Every round is slower than the last (a drifting clock): the paired
      # difference stays 2 ms while each median moves with the drift.
      rounds = order.count(name)
      order.append(name)
      time.sleep((base_ms + rounds) * 1e-3)
      return np.zeros(1)
    return run

  us = calibration.paired_per_op_us({"floor": sleeper("floor", 1), "kernel": sleeper("kernel", 3)}, ops=2, iters=5,
                                    warmup=2, warmup_s=0.0)
  assert order[-10:] == ["floor", "kernel"] * 5, order
  assert us["kernel - floor"] == pytest.approx(2e3 / 2, rel=0.25), us
  assert us["kernel"] > us["floor"] + 0.5e3 and set(us) == {"floor", "kernel", "kernel - floor"}, us


def _lowered(mesh, elems: int) -> str:
  fn = jax.jit(jax.shard_map(lambda x: b12x_jax.all_reduce(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  return fn.lower(jax.ShapeDtypeStruct((2 * elems,), np.float32, sharding=NamedSharding(mesh, P("x")))).as_text()


def _reason_over(mesh, text: str, tmp_path, monkeypatch) -> str:
  """The decision of a 4 MiB all_reduce with ``text`` the stored file: the
  default (one-shot) taken on b12x."""
  monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path))
  (tmp_path / "crossovers.json").write_text(text)
  with fresh_communicator(capacity_bytes=16 * MiB, lamport_bytes=0) as comm, b12x_jax.channel("malformed"):
    assert "algorithm = 0 : i32" in _lowered(mesh, MiB)
  assert comm.decisions[-1].path == "b12x", comm.decisions[-1]
  return comm.decisions[-1].reason


@pytest.mark.parametrize("stored, problem", [({"two_shot_from": "8MiB"}, "two_shot_from is '8MiB'"),
                                             ({"psum_from": -1}, "psum_from is -1"), ("fast", "'fast' is not an object")])
def test_a_stored_calibration_not_as_calibration_writes_it_is_passed_over_saying_why(cpu_mesh, tmp_path, monkeypatch,
                                                                                    stored, problem):
  kind = jax.devices()[0].device_kind
  reason = _reason_over(cpu_mesh(2), json.dumps({f"{kind}/2": stored}), tmp_path, monkeypatch)
  assert f"passed over {tmp_path / 'crossovers.json'}'s entry '{kind}/2': {problem}" in reason, reason


@pytest.mark.parametrize("text, problem", [("[1, 2]", "it holds a JSON list, not an object"),
                                           ('{"NVIDIA', "it is not JSON (Unterminated string")])
def test_a_stored_file_not_as_calibration_writes_it_is_passed_over_saying_why(cpu_mesh, tmp_path, monkeypatch, text,
                                                                             problem):
  reason = _reason_over(cpu_mesh(2), text, tmp_path, monkeypatch)
  assert f"passed over {tmp_path / 'crossovers.json'}: {problem}" in reason, reason


def test_the_stored_calibration_picks_two_shot_and_psum_by_size(cpu_mesh, tmp_path, monkeypatch):
  monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path))
  kind = jax.devices()[0].device_kind
  (tmp_path / "crossovers.json").write_text(json.dumps({f"{kind}/2": {"two_shot_from": 2 * MiB,
                                                                      "psum_from": 8 * MiB}}))
  assert tuning.crossover_for(kind, 2).two_shot_from == 2 * MiB
  assert tuning.crossover_for(kind, 4) == tuning.DEFAULTS.get((kind, 4), tuning.Crossover())
  assert tuning.crossover_for(kind, 2, stored=False) == tuning.DEFAULTS.get((kind, 2), tuning.Crossover())
  mesh = cpu_mesh(2)
  with fresh_communicator(capacity_bytes=16 * MiB, lamport_bytes=0) as comm, b12x_jax.channel("tuned"):
    assert "algorithm = 0 : i32" in _lowered(mesh, MiB // 4)  # 1 MiB: one-shot
    assert "algorithm = 1 : i32" in _lowered(mesh, MiB)  # 4 MiB
    assert "two_shot from 2097152 bytes (calibrated" in comm.decisions[-1].reason
    text = _lowered(mesh, 2 * MiB)  # 8 MiB: psum is faster there
    assert "b12x_all_reduce" not in text and comm.decisions[-1].path == "psum", comm.decisions[-1]
  with fresh_communicator(capacity_bytes=16 * MiB, algorithm="one_shot"), b12x_jax.channel("forced"):
    assert "algorithm = 0 : i32" in _lowered(mesh, 2 * MiB)  # the setting wins over the table
  with fresh_communicator(capacity_bytes=16 * MiB, policy="strict") as comm, b12x_jax.channel("strict"):
    assert "algorithm = 1 : i32" in _lowered(mesh, 2 * MiB)  # strict: never psum, the faster b12x kernel
    assert comm.decisions[-1].path == "b12x"


def test_every_algorithm_lowers_its_attribute_and_gives_the_same_bits_on_the_host(cpu_mesh):
  # The host backend reduces in one shot whatever the attribute; tests/gpu checks each CUDA kernel.
  mesh = cpu_mesh(2)
  shards = random_shards(np.random.default_rng(3), 2, 4096, np.float32)
  fn = jax.jit(jax.shard_map(lambda x: b12x_jax.all_reduce(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  outs = []
  for code, algorithm in enumerate(("one_shot", "two_shot", "one_shot_pull")):
    with fresh_communicator(algorithm=algorithm, lamport_bytes=0), b12x_jax.channel("algo"):
      assert f"algorithm = {code} : i32" in _lowered(mesh, 4096)
      outs.append(np.asarray(fn(jax.device_put(shards.reshape(-1), NamedSharding(mesh, P("x"))))).reshape(2, -1))
  assert_sum_matches(outs[1], shards, "float32")
  assert all(np.array_equal(outs[0].view(np.uint8), out.view(np.uint8)) for out in outs[1:])


def test_calibrate_measures_stores_and_is_read_back(cpu_mesh, tmp_path, monkeypatch):
  monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path))
  mesh = cpu_mesh(2)
  crossover, times = calibration.calibrate(mesh, "x", sizes=(4096, 8192), ops=2, iters=2)
  assert set(times) == {4096, 8192} and all(set(t) == {"one_shot", "two_shot", "psum"} for t in times.values())
  assert all(v > 0 for t in times.values() for v in t.values())
  stored = tuning.crossover_for(mesh.devices.flat[0].device_kind, 2)
  assert (stored.two_shot_from, stored.psum_from) == (crossover.two_shot_from, crossover.psum_from)
  assert stored.source.startswith("calibrated")
  assert not b12x_jax.get_communicator().prepared_channels()  # it leaves a fresh default communicator


def test_a_bad_algorithm_is_a_clear_error():
  with pytest.raises(ValueError, match=r"Communicator: algorithm must be one of \('auto', 'one_shot', 'two_shot', 'one_shot_pull'\)"):
    b12x_jax.Communicator(algorithm="three_shot")
