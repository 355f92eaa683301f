"""The per-call decision (DESIGN C12): which path a traced collective
takes, b12x or its fallback (psum, or all_to_all plus a merge for
dcp_a2a), which kernel kind a b12x call gets, and the log of both
(``decisions``). Apart from the channels' lifecycle (communicator.py):
it reads only the settings the Communicator was made with."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import numpy as np

from b12x_jax import _native
from b12x_jax.errors import IneligibleError

Policy = Literal["auto", "strict", "psum"]
Algorithm = Literal["auto", "one_shot", "two_shot", "one_shot_pull"]
Kernels = Literal["auto", "ffi", "triton"]
_KERNELS = ("auto", "ffi", "triton")
_ALGORITHMS = ("auto", "one_shot", "two_shot", "one_shot_pull")
_POLICIES = ("auto", "strict", "psum")
# Read by Communicator(policy=None): the operator's switch to the psum path.
POLICY_ENV = "B12X_JAX_POLICY"
_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
PACK_BYTES = _native.PACK_BYTES
# Communicator.decisions keeps the last this many (one per traced call).
MAX_DECISIONS = 1024


@dataclasses.dataclass(frozen=True)
class Decision:
  """Which path one traced collective took, and why."""
  op: str
  channel: str
  path: Literal["b12x", "psum", "all_to_all", "unfused"]
  reason: str
  # Which kernel kind a b12x call got ("ffi" or "triton"; None off b12x).
  # A call bound to the Triton kernel that its lowering cannot run gets a
  # second decision, kernel "ffi", saying why.
  kernel: Literal["ffi", "triton"] | None = None


class CallPolicy:
  """The per-call decision of a Communicator, from its settings: ``policy``,
  ``capacity_bytes``, ``kernels`` (set by Communicator.__init__). Keeps
  the last MAX_DECISIONS decisions, oldest first, in ``decisions``."""

  policy: Policy
  to_auto: str = "policy='auto'"  # how to leave "strict" (Communicator.__init__: the variable that set it)
  capacity_bytes: int
  kernels: Kernels
  decisions: list[Decision]

  def _agree(self, channel: str) -> None:
    """Before a call whose group may span processes takes a path: every
    process's settings agree (the Communicator's, across processes)."""

  # -- the per-call decision (DESIGN C12) ------------------------------------

  def choose_path(self, op: str, channel: str, nbytes: int, dtype, axis_size: int, *, unit: str = "payload",
                  arg: str = "x", staged_bytes: int | None = None, fallback: str = "psum",
                  shrink: str | None = None, detail: str = "", prefer_fallback: str | None = None,
                  kernel: tuple[str, str] = ("ffi", "")) -> Decision:
    """Decides, at trace time, whether a call over ``axis_size`` ranks runs
    on b12x or on its ``fallback`` path; raises under policy "strict" where
    b12x cannot run it, naming the op, the argument ``arg`` and the fix.
    Records the decision.

    ``nbytes`` is the ``unit`` of ``dtype`` that must be a multiple of 16
    bytes (all_reduce: the payload; dcp_a2a: one row of out), and
    ``staged_bytes`` (default ``nbytes``) what one call stages per source,
    which must fit ``capacity_bytes``; ``shrink`` says how to stage less
    (default: a smaller ``arg``). ``prefer_fallback``, a reason, takes the
    fallback inside the window too under policy "auto" (a measured crossover
    says it is faster); ``detail`` is added to the reason of a b12x path,
    and so is ``kernel`` (choose_kernel's kind and why), whose kind the
    decision records."""
    # Whether the group spans processes is not known while tracing (an axis
    # of 2 may pair devices of two processes however many each holds): with
    # several processes, every group of more than one device agrees,
    # whichever path each process takes.
    if axis_size > 1 and jax.process_count() > 1:
      self._agree(channel)
    name = np.dtype(dtype).name
    staged = nbytes if staged_bytes is None else staged_bytes
    if self.policy == "psum":
      reason, fix = f"policy 'psum' forces the {fallback} path", ""
    elif name not in _SUPPORTED_DTYPES:
      reason = f"{arg} has dtype {name}, not one of {_SUPPORTED_DTYPES}"
      fix = f"Cast {arg} to one of them ({arg}.astype(jnp.bfloat16))"
    elif nbytes % PACK_BYTES:
      reason = f"{unit} of {nbytes} bytes is not a multiple of 16 bytes"
      fix = f"Pad the {unit} to a multiple of 16 bytes"
    elif staged > self.capacity_bytes:
      reason = f"{arg} stages {staged} bytes per source, which exceeds capacity_bytes={self.capacity_bytes}"
      fix = f"Raise Communicator(capacity_bytes=...) or {shrink or f'split {arg} into smaller calls'}"
    elif axis_size > _native.MAX_RANKS:
      reason = f"the axis has {axis_size} devices, more than the {_native.MAX_RANKS} ranks a channel serves"
      fix = f"Use an axis of at most {_native.MAX_RANKS} devices"
    elif prefer_fallback is not None and self.policy == "auto":
      return self.record(Decision(op, channel, fallback, prefer_fallback))
    else:
      kind, why = kernel
      reason = "inside the b12x window" + "".join(f"; {part}" for part in (detail, why) if part)
      return self.record(Decision(op, channel, "b12x", reason, kernel=kind))
    return self.outside_window(op, channel, reason, fix, fallback)

  def choose_kernel(self, op: str, why_no_triton: str | None) -> tuple[str, str]:
    """The kernel kind of a b12x call by ``kernels``, and why: "triton"
    where asked for (or, under "auto", where the default backend is CUDA)
    and ``why_no_triton`` is None (a Triton kernel exists for the call),
    else "ffi". Under policy "strict", kernels="triton" for a call without a
    Triton kernel raises IneligibleError."""
    if self.kernels == "ffi":
      return "ffi", ""
    if why_no_triton is not None:
      if self.kernels == "triton":
        self._strict_kernel(op, why_no_triton)
      return "ffi", f"the ffi kernel: {why_no_triton}"
    if self.kernels == "auto" and jax.default_backend() != "gpu":
      return "ffi", f"the ffi kernel: kernels='auto' and the default backend is {jax.default_backend()}"
    return "triton", f"the Triton kernel (kernels={self.kernels!r})"

  def kernel_fallback(self, op: str, channel: str, reason: str) -> None:
    """A call bound to the Triton kernel whose lowering cannot run it
    (``reason``): the ffi kernel takes it, recorded; under policy "strict"
    with kernels="triton", an IneligibleError. Returns None (no Triton
    lowering)."""
    if self.kernels == "triton":
      self._strict_kernel(op, reason)
    self.record(Decision(op, channel, "b12x", f"the ffi kernel: {reason}", kernel="ffi"))

  def _strict_kernel(self, op: str, reason: str) -> None:
    if self.policy == "strict":
      raise IneligibleError(f"b12x_jax.{op}: kernels='triton' but {reason} (policy 'strict'). Use "
                            "Communicator(kernels='auto') to let the ffi kernel take such calls")

  def outside_window(self, op: str, channel: str, reason: str, fix: str, fallback: str = "psum") -> Decision:
    """A call b12x cannot run (``reason``): its ``fallback`` path, recorded,
    under policies "auto" and "psum"; under "strict" an IneligibleError that
    says ``fix``."""
    if self.policy == "strict":
      raise IneligibleError(f"b12x_jax.{op}: {reason} (policy 'strict'). {fix}, or use {self.to_auto} to fall "
                            f"back to {fallback}")
    return self.record(Decision(op, channel, fallback, reason))

  def record(self, decision: Decision) -> Decision:
    """Appends ``decision`` to ``decisions``, dropping the oldest beyond
    MAX_DECISIONS."""
    self.decisions.append(decision)
    del self.decisions[:-MAX_DECISIONS]
    return decision

