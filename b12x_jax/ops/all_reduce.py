"""all_reduce: sum over a mesh axis, one-shot or two-shot (DESIGN §1, §2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from b12x_jax import _compat, tuning
from b12x_jax.channels import resolve_channel
from b12x_jax.communicator import get_communicator
from b12x_jax.ops._common import axis_size, collective_primitive

_OP = "all_reduce"
_TARGET = "b12x_all_reduce"
# The `algorithm` attribute of the custom call (ffi/cuda/all_reduce.cu).
_ALGORITHM_CODES = {"one_shot": 0, "two_shot": 1, "one_shot_pull": 2}

# -- validation -----------------------------------------------------------------


def _check_operand(x) -> jax.Array:
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"b12x_jax.{_OP}: x must be an array, got {type(x).__name__}")
  return jnp.asarray(x)


# -- public function -------------------------------------------------------------


def all_reduce(x, axis_name: str, *, channel: str | None = None) -> jax.Array:
  """Sum of ``x`` over the devices of mesh axis ``axis_name``, like
  ``jax.lax.psum(x, axis_name)``.

  Call it inside ``jax.shard_map`` (under ``jax.jit``). Every rank gets the
  same bits: fp32 accumulation in rank order 0..N-1, one rounding to x's
  dtype. Runs on the channel of the enclosing ``b12x_jax.channel`` scope
  (or ``channel``; "default" outside any scope).

  Takes the b12x path for float32/bfloat16/float16 payloads that are a
  multiple of 16 bytes and at most the communicator's ``capacity_bytes``;
  otherwise psum (policy "auto") or an IneligibleError (policy "strict").
  Under "auto", psum also where the measured crossovers say it is faster.
  Above the Lamport window the kernel is one-shot or two-shot by the
  communicator's ``algorithm`` (b12x_jax.tuning when "auto"). The choice
  and the reason are recorded in ``get_communicator().decisions``.
  """
  x = _check_operand(x)
  size = axis_size(axis_name, _OP)
  name = resolve_channel(channel, _OP)
  if size == 1 or x.size == 0:  # nothing crosses a link; psum's type (invariant over the axis)
    return jax.lax.psum(x, axis_name)
  comm = get_communicator()
  nbytes = x.size * x.dtype.itemsize
  algorithm, why, psum_is_faster = _algorithm(comm, nbytes, size)
  decision = comm.choose_path(_OP, name, nbytes, x.dtype, size, detail=why, prefer_fallback=psum_is_faster)
  if decision.path == "psum":
    return jax.lax.psum(x, axis_name)
  return all_reduce_p.bind(x, axis_name=axis_name, channel=name, algorithm=np.int32(_ALGORITHM_CODES[algorithm]))


def _algorithm(comm, nbytes: int, size: int) -> tuple[str, str, str | None]:
  """The kernel for ``nbytes`` over ``size`` ranks above the Lamport window
  ("one_shot", "two_shot" or "one_shot_pull"), why, and why psum would be
  faster (or None): the Communicator's setting, else the crossovers of
  tuning.py. With several processes only the packaged table is used: every
  process must choose alike, and a per-user stored calibration may differ
  between them."""
  if comm.algorithm != "auto":
    return comm.algorithm, f"{comm.algorithm} (Communicator(algorithm={comm.algorithm!r}))", None
  if nbytes <= comm.lamport_bytes:
    return "one_shot", "within lamport_bytes (the Lamport exchange)", None
  crossover = tuning.crossover_for(jax.devices()[0].device_kind, size, stored=jax.process_count() == 1)
  if crossover.two_shot_from is not None and nbytes >= crossover.two_shot_from:
    algorithm, why = "two_shot", f"two_shot from {crossover.two_shot_from} bytes ({crossover.source})"
  else:
    algorithm, why = "one_shot", f"one_shot ({crossover.source})"
  faster = crossover.psum_from is not None and nbytes >= crossover.psum_from
  return algorithm, why, f"psum is faster from {crossover.psum_from} bytes ({crossover.source})" if faster else None


# -- lowering ---------------------------------------------------------------------


def _abstract_eval(x, *, axis_name: str, channel: str, algorithm: int):
  del channel, algorithm
  return _compat.drop_varying_axis(x, axis_name)


def _psum_path(x, *, axis_name: str, algorithm: int = 0):
  del algorithm
  return [jax.lax.psum(x, axis_name)]


# -- registration ----------------------------------------------------------------

all_reduce_p = collective_primitive(_TARGET, _OP, _abstract_eval, _psum_path)
