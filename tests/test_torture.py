"""Torture on the CPU backend (emulated host devices): random programs of
all_reduce and dcp_a2a calls on channels "target" and "draft", interleaved,
every result checked against float64 NumPy (tests/torture.py).

``B12X_TORTURE_CALLS`` sets the collective calls checked by the whole file
(default 1000, split between the meshes) and ``B12X_TORTURE_SEED`` the seed
(default 0; a failure names it); ``-s`` shows one summary line per mesh."""

from __future__ import annotations

import os

import jax
import pytest

import b12x_jax
from helpers import fresh_communicator
from torture import run_torture

CALLS = int(os.environ.get("B12X_TORTURE_CALLS", "1000"))
SEED = int(os.environ.get("B12X_TORTURE_SEED", "0"))
SIZES = (2, 4)


@pytest.mark.parametrize("n", SIZES)
def test_random_programs_on_target_and_draft_give_float64_results(cpu_mesh, n):
  calls = -(-CALLS // len(SIZES))
  with fresh_communicator(poison_outputs=True):  # an element no kernel wrote is NaN and fails its check
    result = run_torture(cpu_mesh(n), "x", seed=SEED, calls=calls, programs=12)
  print(f"TORTURE platform=cpu calls={result['calls']} runs={result['runs']} n={n} programs={result['programs']} "
        f"ops={result['ops']} paths={result['paths']}")
  assert result["calls"] >= calls
  assert result["paths"].get("b12x", 0) > 0 and result["paths"].get("psum", 0) > 0, result


@pytest.mark.parametrize("op", ["all_reduce", "dcp_a2a"])
def test_torture_catches_one_wrong_element(cpu_mesh, monkeypatch, op):
  # The harness itself can fail: a collective whose last element is off by one is reported with the seed.
  real = getattr(b12x_jax, op)

  def off_by_one(*args, **kwargs):
    results = real(*args, **kwargs)
    first = results[0] if isinstance(results, tuple) else results
    first = first.at[(-1,) * first.ndim].add(1)
    return (first,) + results[1:] if isinstance(results, tuple) else first

  monkeypatch.setattr(b12x_jax, op, off_by_one)
  with fresh_communicator(), pytest.raises(AssertionError, match=rf"torture seed=7 .*: op \d+ {op}\("):
    run_torture(cpu_mesh(2), "x", seed=7, calls=40, programs=4)
  jax.effects_barrier()


@pytest.mark.parametrize("n", [5, 6, 7, 8])
def test_five_to_eight_ranks_give_float64_results_too(n):
  # The largest group a channel serves, and those that fill only part of the sources the loops run to
  # (kMaxRanks), on emulated CPU devices in a worker (this process has 4): no 8-GPU machine is lent.
  from conftest import run_worker
  result = run_worker("torture", "--devices", str(n), "--calls", "200", "--programs", "6", "--seed", str(SEED),
                      hard_timeout=300)
  print(f"TORTURE platform=cpu calls={result['calls']} runs={result['runs']} n={n} paths={result['paths']}")
  assert result["calls"] >= 200 and result["paths"].get("b12x", 0) > 0, result
  assert result["ops"].get("AllReduce", 0) > 0 and result["ops"].get("DcpA2a", 0) > 0, result  # both ops at n
