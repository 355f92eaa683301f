"""Communicator: which channels exist in this process and their memory,
from preparation to release (the per-call decision between the b12x path
and the psum path is policy.py's CallPolicy, which it extends with its
settings).

Preparation allocates, zero-fills and connects a channel's memory for one
group of devices (DESIGN C4). It runs before any execution that uses the
channel: explicitly through ``Communicator.prepare``, or, unless strict mode
is on, when a collective is first lowered for that group. It never runs in
the execute stage, under graph capture, or at XLA compile time.

With one process per device (``jax.distributed``), a group spans processes
and its preparation is collective (rendezvous.py): every process of the group
must prepare the same channels, which happens by itself when every process
lowers the same program, or explicitly with ``prepare(mesh, axis, channels)``
called on every process (in any channel order: it runs in sorted order).
Releasing and closing are collective too.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

import jax

from b12x_jax import _compat, _native, rendezvous
from b12x_jax.channels import channel as channel_scope
from b12x_jax.channels import is_strict, validate_channel_name
from b12x_jax.errors import B12xError, ChannelError, CollectiveTimeoutError, GroupUnreachableError, TransportError
from b12x_jax.policy import (_ALGORITHMS, _KERNELS, _POLICIES, PACK_BYTES, POLICY_ENV, Algorithm, CallPolicy, Decision,
                             Kernels, Policy)

MiB = 1 << 20
# A bound on timeouts: "wait forever" is what the bound exists to rule out
# (and the native layer counts nanoseconds in 64 bits).
_MAX_TIMEOUT_S = 1e6


def settle() -> None:
  """Waits until every execution dispatched so far in this process is done,
  so that no call is in flight on a channel about to be released, reset or
  checked. Executions with b12x calls carry no JAX effect or token (docs/
  DESIGN.md, "Call order"), so JAX keeps no record of them: their results
  do, and a result that raised its error already is skipped."""
  for array in jax.live_arrays():
    try:
      array.block_until_ready()
    except Exception:  # noqa: BLE001 - a failed call's error is raised where its results are read
      # It stopped at the first failed shard: the others may still be on their way.
      with contextlib.suppress(Exception):  # deleted meanwhile
        for shard in array.addressable_shards:
          with contextlib.suppress(Exception):
            shard.data.block_until_ready()


def _is_number(value) -> bool:
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class Communicator(CallPolicy):
  """The channels of this process and the rules for using them.

  Args:
    capacity_bytes: staging capacity of one call (per slot), default 8 MiB,
      at most 1 GiB.
      Larger payloads take the psum path (policy "auto") or raise ("strict").
    timeout_s: bound on every wait for a peer (DESIGN C8), default 10 s.
    policy: "auto" falls back to psum outside the b12x window, "strict"
      raises there instead, "psum" forces the psum path for every call
      (dcp_a2a's fallback is jax.lax.all_to_all plus a local merge). None
      (the default) reads the environment variable B12X_JAX_POLICY (empty:
      unset), else "auto": ``B12X_JAX_POLICY=psum`` switches a deployment
      to psum without a code change (it applies to functions traced
      afterwards).
    max_blocks: largest CUDA grid of one call; None takes min(64, SM count).
    lamport_bytes: payloads up to this size take the flagless Lamport
      exchange (no barrier; three more buffers of this size per peer), larger
      ones the staged barrier protocol, on CUDA and CPU alike. 0 turns the
      Lamport path off.
    poison_outputs: debug switch: every output is filled with NaN before the
      kernel writes it, so an element a kernel misses shows up. Costs a memset.
    setup_timeout_s: bound on each collective step of preparing or releasing
      a channel shared between processes (a process that never joins gives
      the others CollectiveTimeoutError), and on the waits of the first call
      after each preparation of a channel shared between processes: they
      reach it seconds to minutes apart (compilation, weight loading), which
      is no fault. Default 60 s.
    algorithm: all_reduce above the Lamport window: "one_shot" (push),
      "two_shot" (reduce-scatter + all-gather), "one_shot_pull" (peers read
      each other's staging; kept to measure against push), or "auto": by
      payload size from the measured crossovers of b12x_jax.tuning (which
      may also pick psum).
    kernels: which kernel kind runs a b12x call: "ffi" (the default: the
      native kernels, every op and size), "triton" (the Pallas Triton kernels
      of the same wire protocol, which XLA launches itself: all_reduce of
      float32 and bfloat16 in the Lamport window, the fused op's rows and
      dcp_a2a of bfloat16, on CUDA; docs/DESIGN.md "Triton kernels"), or
      "auto" (triton where such a kernel exists for the call and the default
      backend is CUDA, else ffi). Both kinds interleave on
      one channel. Where "triton" cannot run a call (another op, dtype or
      size, a CPU lowering: Pallas Triton has no CPU path) the call takes the
      ffi kernel and the decision says why, under policies "auto" and
      "psum"; under "strict" that is an IneligibleError, as asked-for
      behaviour that cannot be had. Every process of a group must have the
      same setting (it changes the program they all lower).
    loopback: for benchmarks and tests only: a mesh axis of one device runs
      the b12x protocol as a group of one whose peer is itself (its payload
      goes through channel memory by the same stores, polls, reduction and
      refill as a peer's: docs/DESIGN.md, "Loopback"), instead of the psum a
      one-device axis takes otherwise (dcp_a2a: instead of a local merge).
      Every op: all_reduce, the fused op and dcp_a2a (a merge of one
      source). No effect on larger axes.

  Channel memory is never freed before the process ends, by ``close()``
  and ``release()`` neither: compiled executables and CUDA graphs may
  still hold its pointers (DESIGN C16). Preparing a released group again
  with the same settings reuses its memory. A Communicator that is
  dropped without ``close()`` releases the channels it holds in this
  process alone when it is garbage-collected; one shared with other
  processes stays prepared (its release is collective).
  """

  def __init__(self, *, capacity_bytes: int = 8 * MiB, timeout_s: float = 10.0,
               policy: Policy | None = None, max_blocks: int | None = None, lamport_bytes: int = 1 * MiB,
               poison_outputs: bool = False, setup_timeout_s: float = 60.0, algorithm: Algorithm = "auto",
               loopback: bool = False, kernels: Kernels = "ffi"):
    if (not _is_int(capacity_bytes) or capacity_bytes < PACK_BYTES or capacity_bytes % PACK_BYTES
        or capacity_bytes > _native.MAX_CAPACITY_BYTES):
      raise ValueError(f"Communicator: capacity_bytes must be a positive multiple of 16 up to "
                       f"{_native.MAX_CAPACITY_BYTES} (1 GiB; larger payloads take psum), got {capacity_bytes!r}")
    for setting, value in (("timeout_s", timeout_s), ("setup_timeout_s", setup_timeout_s)):
      if not _is_number(value) or not 0 < value <= _MAX_TIMEOUT_S:
        raise ValueError(f"Communicator: {setting} must be a number of seconds > 0 and at most {_MAX_TIMEOUT_S:g} "
                         f"(every wait is bounded), got {value!r}")
    if policy is None:
      policy = os.environ.get(POLICY_ENV) or "auto"  # set but empty, as a shell leaves it: unset
      if policy == "strict":
        self.to_auto = f"{POLICY_ENV}=auto (it set 'strict' here)"
      if policy not in _POLICIES:
        raise ValueError(f"Communicator: environment variable {POLICY_ENV} must be one of {_POLICIES}, "
                         f"got {policy!r}")
    if policy not in _POLICIES:
      raise ValueError(f"Communicator: policy must be one of {_POLICIES}, got {policy!r}")
    if max_blocks is not None and (not _is_int(max_blocks) or not 1 <= max_blocks <= _native.MAX_BLOCKS):
      raise ValueError(f"Communicator: max_blocks must be in [1, {_native.MAX_BLOCKS}] or None, got {max_blocks!r}")
    if algorithm not in _ALGORITHMS:
      raise ValueError(f"Communicator: algorithm must be one of {_ALGORITHMS}, got {algorithm!r}")
    if not _is_int(lamport_bytes) or lamport_bytes < 0 or lamport_bytes % PACK_BYTES:
      raise ValueError(f"Communicator: lamport_bytes must be a non-negative multiple of 16, got {lamport_bytes!r}")
    if kernels not in _KERNELS:
      raise ValueError(f"Communicator: kernels must be one of {_KERNELS}, got {kernels!r}")
    for setting, value in (("loopback", loopback), ("poison_outputs", poison_outputs)):
      if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"Communicator: {setting} must be True or False, got {value!r}")
    self.capacity_bytes = int(capacity_bytes)
    self.lamport_bytes = int(lamport_bytes)
    self.poison_outputs = bool(poison_outputs)
    self.timeout_s = float(timeout_s)
    self.setup_timeout_s = float(setup_timeout_s)
    self.policy: Policy = policy
    self.max_blocks = None if max_blocks is None else int(max_blocks)
    self.algorithm: Algorithm = algorithm
    self.loopback = bool(loopback)
    self.kernels: Kernels = kernels
    self.decisions: list[Decision] = []  # the last MAX_DECISIONS traced calls, oldest first
    self._lock = threading.RLock()
    # (platform, channel) -> prepared groups, each a tuple of device ordinals in rank order
    # (-1 for a rank of another process).
    self._groups: dict[tuple[str, str], list[tuple[str, tuple[int, ...]]]] = {}  # (partition, ordinals)
    # (platform, device ids) of groups whose transport failed -> why.
    self._broken: dict[tuple[str, tuple[int, ...]], str] = {}
    # (platform, channel) -> the processes its groups shared with this one span.
    self._shared: dict[tuple[str, str], set[int]] = {}
    # A shared group's preparation (platform, channel, partition, ordinals) -> the name
    # every process gives it, and the records of each kind exchanged for it (exchange_records).
    self._preparations: dict[tuple[str, str, str, tuple[int, ...]], str] = {}
    self._records: dict[tuple[str, str], dict[int, bytes]] = {}
    self._exchanging: dict[tuple[str, str], threading.Lock] = {}  # (preparation, kind) -> its exchange's lock
    self._agreed: set[str] = set()  # channels whose settings every process agreed on (_agree)
    self._agreeing: dict[str, threading.Lock] = {}  # channel -> the lock its agreement is made under
    self._preparing: dict[tuple[str, str], threading.Lock] = {}  # (platform, channel) -> its preparations' lock
    self._closed = False
    self.generation = next(_generations)  # tells communicators apart in jit's cache key
    self._releases = 0
    # A communicator dropped without close() takes its one-process groups out
    # of use, so another may prepare their channels (a shared group's release
    # is collective: it stays until close() in every process, or exit).
    self._abandoned = weakref.finalize(self, _release_local_groups, self._groups)
    self._abandoned.atexit = False

  # -- agreement across processes (C17) -------------------------------------

  def _agree(self, channel: str) -> None:
    """Once per channel: this process's settings against every other's
    (rendezvous.agree), before its first call on the channel takes a path.
    Threads tracing one channel at once agree one after the other: an
    agreement is a session every process counts, so a second one would
    pair with another session of its peers. Channels agree apart: a lock
    for all would let two processes whose threads took two channels in
    opposite orders wait for each other until both time out."""
    with self._lock:
      if channel in self._agreed:
        return
      agreeing = self._agreeing.setdefault(channel, threading.Lock())
    with agreeing:
      with self._lock:
        if channel in self._agreed:
          return
      rendezvous.agree(channel, self._settings(), range(jax.process_count()), self.setup_timeout_s)
      with self._lock:
        self._agreed.add(channel)

  @property
  def lamport_window(self) -> int:
    """Payloads up to this many bytes take the Lamport exchange (0: none),
    by the rule every handler applies (_native.payload_limits)."""
    return _native.payload_limits(self.native_options())[1]

  # -- preparation -------------------------------------------------------------

  def native_options(self, first_call_s: float | None = None):
    """The native ChannelOptions of this communicator's channels; the first
    call after a preparation waits up to ``first_call_s`` (default
    setup_timeout_s) for its peers."""
    return _native.channel_options(capacity_bytes=self.capacity_bytes, lamport_bytes=self.lamport_bytes,
                                   timeout_s=self.timeout_s,
                                   setup_timeout_s=self.setup_timeout_s if first_call_s is None else first_call_s,
                                   max_blocks=self.max_blocks, poison_outputs=self.poison_outputs,
                                   loopback=self.loopback)

  def prepare(self, mesh, axis_name: str, channels: Iterable[str] = ("default",)) -> None:
    """Prepares ``channels`` for every device group of ``mesh`` along
    ``axis_name``, in sorted channel-name order. Needed before use in strict
    mode; otherwise optional (the first lowering prepares).

    Where a group spans processes this is collective: call it on every
    process with the same mesh, axis and channels (their order may differ).
    If any process fails, every process raises and nothing stays mapped.

    A module from ``jax.export.deserialize`` with calls on these channels
    runs after this (README, "jax.export")."""
    if not isinstance(mesh, jax.sharding.Mesh):
      raise TypeError(f"Communicator.prepare: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; "
                      f"make one with jax.make_mesh")
    if axis_name not in mesh.axis_names:
      raise ValueError(f"Communicator.prepare: axis_name {axis_name!r} is not one of the mesh axes "
                       f"{tuple(mesh.axis_names)}")
    if isinstance(channels, str):
      raise TypeError(f"Communicator.prepare: channels must be a list of channel names, got the string "
                      f"{channels!r}; write channels=[{channels!r}]")
    if not isinstance(channels, Iterable):
      raise TypeError(f"Communicator.prepare: channels must be a list of channel names, got {channels!r}")
    names = sorted({validate_channel_name(c, "Communicator.prepare(channels=...)") for c in channels})
    if mesh.shape[axis_name] > _native.MAX_RANKS:
      raise ValueError(f"Communicator.prepare: axis {axis_name!r} has {mesh.shape[axis_name]} devices; a channel "
                       f"serves at most {_native.MAX_RANKS} (one host's GPUs), and calls over a larger axis take "
                       f"psum: prepare an axis of at most {_native.MAX_RANKS} devices")
    # What a module from jax.export.deserialize needs besides the memory: the
    # FFI targets (its b12x calls are not lowered here).
    _native.ensure_registered()
    settle()
    devices = np.moveaxis(np.asarray(mesh.devices, dtype=object), list(mesh.axis_names).index(axis_name), -1)
    groups = [tuple(row) for row in devices.reshape(-1, devices.shape[-1])]
    for name in names:
      for group in groups:
        self._prepare_group("Communicator.prepare", name, partition_key(groups), group)

  def ensure_prepared(self, op: str, channel: str, groups: Sequence[Sequence],
                      fallback: str = "psum") -> Decision | None:
    """Called while lowering: makes sure every device group has ``channel``.
    Returns a Decision for the ``fallback`` path when the transport of a
    group is broken and the policy allows the fallback, else None.

    Groups that span processes are prepared collectively here, while each
    process lowers: every process lowers the same program, so all reach the
    same preparations in the same order, and a failed transport is one
    verdict, so all take the same path."""
    partition = partition_key(groups)
    for group in groups:
      platform = _compat.platform_of(group)
      if platform not in _native.platforms():
        return self._ineligible(op, channel, f"no b12x backend for platform {platform!r} in this build (for CUDA, "
                                "rebuild with nvcc on PATH, B12X_CUDA=ON)", fallback)
      ordinals = _ordinals(group)
      if all(o < 0 for o in ordinals):
        continue  # other processes serve this group
      # By the group's devices, not this process's ordinals: another group (an
      # axis across hosts) may have the same local ordinals, and every process
      # of a group must reach one verdict.
      devices = tuple(d.id for d in group)
      broken = self._broken.get((platform, devices))
      if broken is None and not self._is_prepared(platform, channel, partition, ordinals):
        if is_strict():
          raise ChannelError(
              f"b12x_jax.{op}: channel {channel!r} is not prepared for devices {list(ordinals)} and strict "
              f"mode is on; call b12x_jax.get_communicator().prepare(mesh, axis_name, "
              f"channels=[{channel!r}]) before tracing")
        try:
          self._prepare_group(op, channel, partition, group)
        except GroupUnreachableError as e:  # remembered: the group is not probed again, for any channel
          broken = self._broken[(platform, devices)] = str(e)
        except TransportError as e:  # this channel's (its memory): its next lowering tries again, the others go on
          return self._ineligible(op, channel, str(e), fallback)
      if broken is not None:
        return self._ineligible(op, channel, broken, fallback)
    return None

  def _ineligible(self, op: str, channel: str, reason: str, fallback: str) -> Decision:
    if self.policy == "strict":
      raise TransportError(f"b12x_jax.{op}: {reason} (policy 'strict'; {self.to_auto} falls back to {fallback})")
    return self.record(Decision(op, channel, fallback, reason))

  def _is_prepared(self, platform: str, channel: str, partition: str, ordinals: tuple[int, ...]) -> bool:
    with self._lock:
      return (partition, ordinals) in self._groups.get((platform, channel), ())

  def _prepare_group(self, op: str, channel: str, partition: str, group: Sequence) -> None:
    """Prepares ``channel`` for ``group``, one group of ``partition`` (every
    group of one mesh axis: partition_key), DESIGN C18, for ``op`` (named
    in its errors)."""
    platform = _compat.platform_of(group)
    ordinals = _ordinals(group)
    if all(o < 0 for o in ordinals):
      return
    if len({d.id for d in group}) != len(group):
      raise ChannelError(f"b12x_jax: device group {[d.id for d in group]} names a device twice")
    # One channel's preparations one after the other, each channel's apart:
    # a preparation shared between processes waits for its peers, and two
    # processes whose threads took two channels in opposite orders would
    # each hold one lock for all while the other waits for it.
    with self._lock:
      preparing = self._preparing.setdefault((platform, channel), threading.Lock())
    with preparing:
      with self._lock:
        if self._closed:
          raise ChannelError("b12x_jax: this Communicator is closed; make a new one (b12x_jax.set_communicator)")
        if (partition, ordinals) in self._groups.get((platform, channel), ()):
          return
      processes = {d.process_index for d in group}
      # Processes reach a channel's first call apart (compilation, weight
      # loading); the devices of one process start an executable together.
      options = self.native_options(first_call_s=self.setup_timeout_s if len(processes) > 1 else self.timeout_s)
      _native.await_even_refusals(op, platform, channel, partition, list(ordinals), self.timeout_s)
      if len(processes) == 1:
        _native.prepare(platform, channel, partition, list(ordinals), options)
      else:
        group_key = "-".join(str(d.id) for d in group)  # global ids: the same name in every process
        preparation = rendezvous.prepare_shared(platform, channel, partition, group_key, processes, list(ordinals),
                                                options, self._settings(), self.setup_timeout_s)
      with self._lock:
        if len(processes) > 1:
          self._preparations[(platform, channel, partition, ordinals)] = preparation
          self._shared.setdefault((platform, channel), set()).update(processes)
        self._groups.setdefault((platform, channel), []).append((partition, ordinals))

  def exchange_records(self, channel: str, partition: str, group: Sequence, kind: str,
                       local: dict[int, bytes]) -> dict[int, bytes]:
    """Every rank's record of ``kind`` for ``group`` of the prepared
    ``channel`` (rank -> bytes): ``local`` for this process's ranks, the
    others' as their processes published them for the same preparation
    (waiting up to setup_timeout_s for each). For what every process must
    bake into the one program they all lower (the Triton kernel's address
    table: DESIGN "Triton kernels"). Published once per preparation."""
    platform, ordinals = _compat.platform_of(group), _ordinals(group)
    with self._lock:
      preparation = self._preparations.get((platform, channel, partition, ordinals))
      if preparation is None:  # one process holds the group
        return dict(local)
      exchanging = self._exchanging.setdefault((preparation, kind), threading.Lock())
    # The wait for peers holds this exchange's lock only: a thread lowering
    # another channel goes on, as the other processes' threads may need it to
    # publish what this one waits for (as _prepare_group's locks).
    with exchanging:
      with self._lock:
        records = self._records.get((preparation, kind))
        publish = records is None
        if publish:  # cached first: a key is published once, even if publishing fails half way
          records = self._records[(preparation, kind)] = dict(local)
      if publish:
        rendezvous.publish_records(preparation, kind, local)
      missing = [rank for rank, ordinal in enumerate(ordinals) if ordinal < 0 and rank not in records]
      records.update(rendezvous.fetch_records(preparation, kind, missing, self.setup_timeout_s))
      return dict(records)

  def _settings(self) -> rendezvous.Settings:
    """What peers in other processes must share with this one (DESIGN C17)."""
    return rendezvous.Settings(self.algorithm, self.policy, self.capacity_bytes, self.lamport_bytes,
                               self.max_blocks or 0, self.timeout_s, self.poison_outputs, self.kernels)

  # -- inspection --------------------------------------------------------------

  def prepared_channels(self) -> dict[str, list[tuple[int, ...]]]:
    """Channel name -> prepared device groups (ordinals in rank order)."""
    with self._lock:
      out: dict[str, list[tuple[int, ...]]] = {}
      for (_, channel), groups in self._groups.items():
        out.setdefault(channel, []).extend(ordinals for _, ordinals in groups)
      return out

  def stats(self, channel: str, device) -> dict:
    """Read-only state of ``device``'s rank on ``channel``: rank, world,
    epoch (calls completed; a two-shot all-reduce counts two), poisoned,
    capacity_bytes, lamport_bytes (0 where the Lamport path is off). The
    epoch counts barriers and Lamport calls together. For tests and
    debugging; on CUDA it copies from the device."""
    if not isinstance(device, jax.Device):
      raise TypeError(f"Communicator.stats: device must be a jax.Device (e.g. mesh.devices.flat[0]), got {device!r}")
    return _native.stats(_compat.platform_of([device]), channel, _compat.device_ordinal(device))

  def _start_counters(self, channel: str, calls: int) -> None:
    """Test only: the prepared ``channel`` starts as if ``calls`` calls had
    run (uint32, e.g. just below 2**32 to cross the wrap: docs/DESIGN.md,
    "Wrap"). Call it right after preparation, before any call on the
    channel, on every process of the group, and where the group spans
    processes meet them all at a barrier before the first call (peers write
    into the signal words it sets): the ranks' counters must agree."""
    with self._lock:
      for platform, name in self._groups:
        if name == channel:
          _native.start_counters(platform, channel, calls)

  def check_errors(self) -> None:
    """Raises CollectiveTimeoutError if any wait of this process timed out,
    also one replayed from a CUDA graph (no handler ran to report it). First
    waits for the executions dispatched in this process whose results are
    alive and for the host backend's calls queued so far (each ends within
    its timeouts), so a failure of one of them is reported, not missed: a
    call that raised may have peers whose own timeout is still running.
    Host calls still running after the bound are reported as such. Never
    call it from a host callback inside a program: it would wait for that
    program until its peers time out."""
    settle()
    messages = _native.pending_errors()
    if messages:
      raise CollectiveTimeoutError("\n".join(messages))

  # -- teardown (DESIGN C11) ---------------------------------------------------

  def release(self, channel: str) -> bool:
    """Takes ``channel`` out of use on every platform once the work queued on
    it is done; it can be prepared again later under the same name. First
    waits for the executions this thread dispatched on it; then CUDA groups
    have their kernels on the device, and CPU groups wait for the calls
    queued on the progress thread, at most 2 * timeout_s + 1 s (each call
    ends within one timeout; 2 * max(timeout_s, setup_timeout_s) + 1 s for
    a group across processes, whose calls wait up to setup_timeout_s),
    else raise CollectiveTimeoutError.

    The memory is never freed before the process ends (DESIGN C16): a cached
    executable or CUDA graph may still point at it. Preparing the same group
    with the same settings again reuses it, reset; a cached executable run
    after ``release`` and before that raises "not prepared" (or, replayed
    from a CUDA graph, runs on the kept memory: never on freed memory); a
    jitted function is traced again on its next call instead (a release is
    part of jit's cache key), and that prepares the channel by itself.

    Where the channel is shared between processes this is collective
    (rendezvous.release_shared): call it on every process.

    Returns whether ``channel`` was prepared here: a name this Communicator
    holds no group of (a typo, a channel never called) releases nothing and
    makes nothing trace again."""
    validate_channel_name(channel, "Communicator.release")
    return self._release(channel, self.setup_timeout_s)

  def _release(self, channel: str, timeout_s: float) -> bool:
    """``release``, whose collective step waits at most ``timeout_s``."""
    settle()
    with self._lock:
      if not any(name == channel for _, name in self._groups):
        return False
      self._releases += 1
      if self is _active:  # what was traced on the channel is traced again, and prepares it again
        _communicator_key.set_global(self.cache_key())
      for platform, name in list(self._groups):
        if name != channel:
          continue
        groups = self._groups.pop((platform, name))
        for key in [k for k in self._preparations if k[:2] == (platform, name)]:
          preparation = self._preparations.pop(key)
          self._records = {k: r for k, r in self._records.items() if k[0] != preparation}
          self._exchanging = {k: lock for k, lock in self._exchanging.items() if k[0] != preparation}
        processes = self._shared.pop((platform, name), None)
        if processes is None:
          _native.release(platform, channel, groups)
        else:
          rendezvous.release_shared(platform, channel, groups, processes, timeout_s)
    return True

  def close(self) -> None:
    """Releases every channel, in sorted name order (collective where shared
    between processes: every process calls it). Harmless to call twice.
    Once a release times out, the rest wait for no peer: a dead peer costs
    one ``setup_timeout_s``, not one per channel (a live peer's later
    releases raise too, as each takes its channel out of use; this process
    raises the first error)."""
    with self._lock:
      errors = []
      timeout_s = self.setup_timeout_s
      for channel in sorted({name for _, name in self._groups}):
        try:
          self._release(channel, timeout_s)
        except B12xError as e:  # release the rest, then report
          errors.append(e)
          if isinstance(e, CollectiveTimeoutError):
            timeout_s = 0.0
      self._closed = True
      self._abandoned.detach()
      if errors:
        raise errors[0]

  @contextlib.contextmanager
  def throwaway(self, channel: str) -> Iterator[str]:
    """A channel scope for throwaway work (a profiling compile, a warm-up):
    traces the block on ``channel``, then releases the channel whether the
    block succeeded or raised (collectively where it is shared between
    processes: every process must leave the block), so the name can be
    prepared again later. A jitted function traced inside prepares the
    channel again by itself on its next call (it is traced again); an
    AOT-compiled one runs again only after ``prepare``."""
    with channel_scope(channel):
      try:
        yield channel
      finally:
        self.release(channel)

  def cache_key(self) -> tuple[int, int]:
    """This communicator's part of jit's cache key: which communicator, and
    how many releases ago a function was traced (every release retraces)."""
    return (self.generation, self._releases)

  @property
  def closed(self) -> bool:
    return self._closed


def partition_key(groups: Sequence[Sequence]) -> str:
  """The name of a partition of devices into groups (every group of one
  mesh axis, in rank order): their global ids, "0,1;2,3". A channel name
  serves any number of partitions, with memory of its own for each group
  (DESIGN C18); the custom call names it in its ``group`` attribute."""
  return ";".join(",".join(str(d.id) for d in group) for group in groups)


def _ordinals(group: Sequence) -> tuple[int, ...]:
  """The group's device ordinals in this process, in rank order (rank =
  position in the axis group), -1 for a device of another process."""
  me = jax.process_index()
  return tuple(_compat.device_ordinal(d) if d.process_index == me else -1 for d in group)


def _release_local_groups(groups: dict) -> None:
  """Takes the groups of ``groups`` (a dropped Communicator's: its
  finalizer) that no other process shares out of use."""
  for (platform, channel), held in list(groups.items()):
    local = [(partition, ordinals) for partition, ordinals in held if min(ordinals) >= 0]
    if local:
      _native.release(platform, channel, local)


_active: Communicator | None = None
_active_lock = threading.Lock()


def get_communicator() -> Communicator:
  """The communicator of this process; a default one is made on first use,
  under the cache key set at import, so the first traced function is not
  traced (and compiled) a second time."""
  global _active
  with _active_lock:
    if _active is None:
      _active = Communicator()
      _active.generation = _DEFAULT_GENERATION  # its key, (0, 0), is already jit's
    return _active


def set_communicator(communicator: Communicator) -> None:
  """Makes ``communicator`` the one collectives use from now on. The previous
  one must hold no prepared channel: close() it first."""
  if not isinstance(communicator, Communicator):
    raise TypeError(f"set_communicator: expected a Communicator, got {type(communicator).__name__}")
  with _active_lock:
    if _active is not None and _active is not communicator and _active.prepared_channels():
      raise ChannelError("set_communicator: the current communicator still holds prepared channels "
                         f"{sorted(_active.prepared_channels())}; call its close() first")
    _install(communicator)


# Part of jit's cache key, like the channel scope: the path each traced call
# takes depends on the communicator's settings, so a function traced under
# one communicator is traced again under the next instead of reusing
# decisions (and channels) the new one never made.
_communicator_key = jax.make_user_context(default_value=None)
_DEFAULT_GENERATION = 0  # the default communicator's, whose key is set here, before any trace
_generations = itertools.count(_DEFAULT_GENERATION + 1)
_communicator_key.set_global((_DEFAULT_GENERATION, 0))


def _install(communicator: Communicator) -> None:
  global _active
  _active = communicator
  _communicator_key.set_global(communicator.cache_key())


def check_errors() -> None:
  """Raises CollectiveTimeoutError if a wait timed out anywhere in this process."""
  get_communicator().check_errors()


def _close_at_exit() -> None:
  # Registered after jax's own exit hooks (b12x_jax imports jax first), so it
  # runs before them: pending work finishes, then memory is released while
  # the backends, and jax.distributed for the collective release, still exist.
  # Last, the host backend's progress thread stops: none of its threads may
  # still run inside XLA while the process tears down.
  try:
    if _active is not None and _active.prepared_channels():
      _active.close()  # release first waits for the dispatched executions (settle)
  finally:
    _native.shutdown_host_progress(2 * (_active.timeout_s if _active is not None else 10.0) + 1)


atexit.register(_close_at_exit)
