"""Channel memory outlives every executable that points at it (DESIGN C16).

release() takes a channel out of use but never frees its memory: a cached
executable (on CUDA, a CUDA graph replayed without its handler) may still
point at it. Preparing the same group with the same settings reuses it,
reset; a cached executable run in between raises "not prepared".
tests/test_multiprocess.py runs the same across processes, and the GPU rig
under compute-sanitizer.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import WORKERS
from helpers import assert_sum_matches, fresh_communicator, put_sharded, random_shards
from jax.sharding import PartitionSpec as P

import b12x_jax


def test_a_cached_executable_raises_not_prepared_after_release_and_is_right_once_prepared_again(cpu_mesh):
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(11)
  with fresh_communicator(poison_outputs=True) as comm:
    fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with b12x_jax.channel("reused"):
      for cycle in range(3):
        for _ in range(2):
          shards = random_shards(rng, 2, 1024, np.float32)
          assert_sum_matches(np.asarray(fn(put_sharded(mesh, shards))).reshape(2, -1), shards, "float32")
        assert comm.stats("reused", mesh.devices[0])["epoch"] == 2  # reset at every preparation
        comm.release("reused")
        with pytest.raises(Exception, match="channel 'reused' is not prepared on device"):
          np.asarray(fn(put_sharded(mesh, shards)))
        comm.prepare(mesh, "x", channels=["reused"])
    assert fn._cache_size() == 1  # one executable all along: nothing was traced again


def test_a_process_that_exits_with_calls_in_flight_ends_cleanly():
  for _ in range(5):  # the abort it prevents was intermittent
    proc = subprocess.run([sys.executable, WORKERS, "exit_busy", "--devices", "4", "--runs", "100"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "RESULT" in proc.stdout, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-2000:]
