"""Exchanges between the processes of one channel group, through the
``jax.distributed`` key-value store (docs/DESIGN.md, "Transports"; C4, C11).

Two things travel: a ``Frame`` per rank, the versioned binary record of
what a peer needs to open that rank's memory (CUDA IPC handles, a
shared-memory name) and of the layout it must agree on; and a verdict per
process and step, which is also the barrier of that step. Every step of a
preparation or release ends with ``Session.verdict``: every process learns
whether every other one succeeded, so all raise together or none does.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence

from b12x_jax import _compat, _native
from b12x_jax._version import __version__
from b12x_jax.errors import B12xError, ChannelError, CollectiveTimeoutError, GroupUnreachableError, TransportError

FRAME_MAGIC = b"B12X"
FRAME_VERSION = 4
# magic, version, platform, poison_outputs, rank, world, process,
# block_bytes, lamport_block_bytes, max_blocks (the layout), capacity_bytes,
# lamport_bytes, max_blocks, timeout_s (the settings), then the lengths of the
# channel name, host, build, algorithm, policy, kernels and payload; then
# those six strings (UTF-8) and the payload. Little-endian, no padding: the same bytes on every
# host.
_HEADER = struct.Struct("<4sHBBiiiQQiQQidHHHBBBI")
_VERSION = struct.Struct("<4sH")  # the part every version shares
_PLATFORMS = ("cpu", "cuda")
# Overrides the host identity (host_id): tests make two local processes look
# like two hosts with it.
HOST_ID_ENV = "B12X_JAX_HOST_ID"


def build_id() -> str:
  """What this process's b12x_jax speaks: its version and its native
  protocol word (_native.PROTOCOL). Processes of one group must match."""
  return f"b12x_jax {__version__}, protocol {_native.PROTOCOL:016x}"


def host_id() -> str:
  """The host this process runs on: $B12X_JAX_HOST_ID if set, else the
  hostname and the kernel's boot id (two machines that share a hostname,
  containers, still differ). Processes on different hosts cannot map each
  other's memory (DESIGN C12)."""
  override = os.environ.get(HOST_ID_ENV)
  if override:
    return override
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      boot = f.read().strip()
  except OSError:
    boot = "no boot id"
  return f"{socket.gethostname()} ({boot})"


# The kernel's range of ports for outgoing connections (Linux).
EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"


def coordinator_port() -> int:
  """A port for a ``jax.distributed`` coordinator on this host that no
  socket holds now, for a launcher that starts the processes itself. It
  lies outside the kernel's ephemeral range (from 10000 up): between this
  check and the coordinator's bind, any process's outgoing connection can
  take an ephemeral port ("Address already in use"), never one outside."""
  import random
  try:
    with open(EPHEMERAL_PORTS) as f:
      start, end = map(int, f.read().split())
  except (OSError, ValueError):
    start, end = 32768, 60999  # Linux's default
  candidates = [*range(10000, start), *range(end + 1, 65536)]
  for port in random.sample(candidates, min(100, len(candidates))):
    if port_is_free(port):
      return port
  raise RuntimeError(f"no free port from 10000 outside the ephemeral range {start}-{end} for a jax.distributed "
                     "coordinator: narrow the range (sysctl net.ipv4.ip_local_port_range)")


def port_is_free(port: int) -> bool:
  """Whether no socket holds ``port`` on IPv6, where the host has it (the
  coordinator binds [::], both families), or on IPv4."""
  for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
    try:
      with socket.socket(family) as s:
        s.bind((host, port))
    except OSError as e:
      if family != socket.AF_INET6 or e.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
        return False
  return True


_SAME_COMMUNICATOR = "pass the same Communicator({}=...) in every process"


@dataclasses.dataclass(frozen=True)
class Settings:
  """A process's Communicator settings that change the wire protocol or the
  per-call decision (which path a call takes, its grid, its staging): every
  process of a group must have the same (DESIGN C17). Each field's metadata
  says how to make them agree."""
  algorithm: str = dataclasses.field(metadata={"fix": _SAME_COMMUNICATOR.format("algorithm")})
  policy: str = dataclasses.field(metadata={
      "fix": "pass the same Communicator(policy=...) in every process, or set the environment variable "
             "B12X_JAX_POLICY the same in every process (each reads its own)"})
  capacity_bytes: int = dataclasses.field(metadata={"fix": _SAME_COMMUNICATOR.format("capacity_bytes")})
  lamport_bytes: int = dataclasses.field(metadata={"fix": _SAME_COMMUNICATOR.format("lamport_bytes")})
  max_blocks: int = dataclasses.field(metadata={"fix": _SAME_COMMUNICATOR.format("max_blocks")})  # 0: as many as fit
  timeout_s: float = dataclasses.field(metadata={"fix": _SAME_COMMUNICATOR.format("timeout_s")})
  poison_outputs: bool = dataclasses.field(metadata={"fix": _SAME_COMMUNICATOR.format("poison_outputs")})
  # Each process bakes its kernels' choice into the program they all lower:
  # programs that differ hang XLA:GPU's sharded autotuning (DESIGN "Triton kernels").
  kernels: str = dataclasses.field(metadata={"fix": _SAME_COMMUNICATOR.format("kernels")})


def check_agreement(channel: str, settings: dict[int, Settings]) -> None:
  """Raises ChannelError naming the first setting on which the processes
  (process -> its Settings) disagree, every process's value of it, and
  the fix. Every process that checks the same table raises the same."""
  for field in dataclasses.fields(Settings):
    values = {p: getattr(s, field.name) for p, s in sorted(settings.items())}
    if len(set(values.values())) > 1:
      held = ", ".join(f"process {p} has {field.name}={v!r}" for p, v in values.items())
      raise ChannelError(f"b12x_jax: channel {channel!r}: the processes of a group must agree on every setting "
                         f"that changes the protocol or the path of a call, but {held}: {field.metadata['fix']}")


def agree(channel: str, settings: Settings, processes: Sequence[int], timeout_s: float) -> None:
  """The settings of every process of ``processes`` before a call on
  ``channel`` whose group spans them takes a path (Communicator.choose_path,
  at trace time): processes that disagree, also where one takes the psum
  path and prepares nothing, all raise the same ChannelError
  (check_agreement) instead of meeting at different collectives; a process
  that does not trace the call within ``timeout_s`` makes the others raise
  CollectiveTimeoutError. The n-th agreement on a channel in every process
  is one session: every process traces the same program."""
  session = Session(f"agree/{channel}", processes, timeout_s, _AGREE_ADVICE)
  words = session.gather("settings", json.dumps({"build": build_id(),
                                                 "settings": dataclasses.asdict(settings)}).encode())
  peers = {}
  for p, word in words.items():
    try:
      peers[p] = json.loads(word)
      peers[p]["settings"] = Settings(**peers[p]["settings"])
    except (ValueError, KeyError, TypeError):
      raise ChannelError(f"b12x_jax: channel {channel!r}: process {p} published settings this build of b12x_jax "
                         f"({build_id()}) cannot read; install the same b12x_jax build in every process") from None
  check_builds(channel, {p: peer["build"] for p, peer in peers.items()})
  check_agreement(channel, {p: peer["settings"] for p, peer in peers.items()})


def check_builds(channel: str, builds: dict[int, str]) -> None:
  """Raises ChannelError naming two processes (process -> build_id) whose
  builds differ: two builds may lay out or read a channel's memory
  differently. Every process that checks the same table raises the same."""
  first, *rest = sorted(builds.items())
  for p, build in rest:
    if build != first[1]:
      raise ChannelError(f"b12x_jax: channel {channel!r}: process {first[0]} runs {first[1]}, process {p} runs "
                         f"{build}; install the same b12x_jax build in every process")


@dataclasses.dataclass(frozen=True)
class Frame:
  """What rank ``rank`` of a channel, held by process ``process`` on host
  ``host`` with b12x_jax ``build`` (build_id), publishes for its peers."""
  platform: str
  channel: str
  rank: int
  world: int
  process: int
  host: str
  build: str
  settings: Settings
  layout: tuple[int, int, int]  # (block_bytes, lamport_block_bytes, max_blocks): equal on every rank
  payload: bytes

  def encode(self) -> bytes:
    s = self.settings
    strings = [v.encode() for v in (self.channel, self.host, self.build, s.algorithm, s.policy, s.kernels)]
    return _HEADER.pack(FRAME_MAGIC, FRAME_VERSION, _PLATFORMS.index(self.platform), s.poison_outputs, self.rank,
                        self.world, self.process, *self.layout, s.capacity_bytes, s.lamport_bytes, s.max_blocks,
                        s.timeout_s, *map(len, strings), len(self.payload)) + b"".join(strings) + self.payload

  @classmethod
  def decode(cls, data: bytes) -> Frame:
    """The frame in ``data``; ChannelError if it is not a frame of this version."""
    if len(data) < _VERSION.size or data[:4] != FRAME_MAGIC:
      raise ChannelError("b12x_jax: a peer published something that is not a b12x_jax frame")
    version = _VERSION.unpack_from(data)[1]
    if version != FRAME_VERSION:
      raise ChannelError(f"b12x_jax: a peer speaks frame version {version}, this process {FRAME_VERSION}: run the "
                         "same b12x_jax in every process")
    if len(data) < _HEADER.size:
      raise ChannelError("b12x_jax: a peer's frame is truncated or malformed")
    (_, _, platform, poison, rank, world, process, block, lamport_block, blocks, capacity, lamport, max_blocks,
     timeout_s, *lengths) = _HEADER.unpack_from(data)
    if len(data) != _HEADER.size + sum(lengths) or platform >= len(_PLATFORMS):
      raise ChannelError("b12x_jax: a peer's frame is truncated or malformed")
    fields, at = [], _HEADER.size
    for length in lengths:
      fields.append(data[at:at + length])
      at += length
    channel, host, build, algorithm, policy, kernels = (f.decode() for f in fields[:6])
    settings = Settings(algorithm, policy, capacity, lamport, max_blocks, timeout_s, bool(poison), kernels)
    return cls(_PLATFORMS[platform], channel, rank, world, process, host, build, settings,
               (block, lamport_block, blocks), fields[6])

  def check_peer(self, peer: Frame, rank: int) -> None:
    """Raises ChannelError naming the field where ``peer``, published as
    rank ``rank``, disagrees with this rank's frame: the build first (two
    builds may lay out or read the channel's memory differently), its
    identity next, then the settings (naming both processes and both
    values, and the fix).
    The layout, which the host's devices may change, is ``check_layout``'s."""
    check_builds(self.channel, {self.process: self.build, peer.process: peer.build})
    for field, want, got in [("rank", rank, peer.rank), ("platform", self.platform, peer.platform),
                             ("channel", self.channel, peer.channel), ("world", self.world, peer.world)]:
      if want != got:
        raise ChannelError(f"b12x_jax: channel {self.channel!r}: rank {rank}'s {field} is {got!r}, rank "
                           f"{self.rank}'s is {want!r}; make the Communicator the same in every process")
    check_agreement(self.channel, {self.process: self.settings, peer.process: peer.settings})

  def check_layout(self, peer: Frame, rank: int) -> None:
    """Raises ChannelError if rank ``rank``'s memory layout differs from this rank's."""
    if self.layout != peer.layout:
      raise ChannelError(f"b12x_jax: channel {self.channel!r}: rank {rank}'s layout (block_bytes, "
                         f"lamport_block_bytes, max_blocks) is {peer.layout!r}, rank {self.rank}'s is "
                         f"{self.layout!r}; make the Communicator the same in every process")


_SETUP_ADVICE = ("Preparing and releasing a channel shared between processes are collective: every process of the "
                 "group must make the same calls (Communicator.prepare / release / close, or lower the same program "
                 "with the same Communicator settings: a process with policy 'psum', or a window its call falls "
                 "outside of, prepares nothing); raise Communicator(setup_timeout_s=...) if a process is only slow.")
_AGREE_ADVICE = ("Tracing a call whose axis may span processes is collective: every process of jax.distributed "
                 "compares its settings before the call takes a path, so every process must trace the same program "
                 "(a program on the devices of only some processes cannot use b12x_jax, not even its psum path); "
                 "raise Communicator(setup_timeout_s=...) if a process is only slow.")
# Where each process last waited for its peers (overwritten at every step):
# a timeout names what the missing process was doing instead.
_LAST_STEP = "b12x/last_step"
_sessions: collections.Counter[str] = collections.Counter()
_sessions_lock = threading.Lock()


# What a process that waited in vain for a peer's word of a step writes in
# its place (no word of UTF-8 text starts with 0xFF): the peer, arriving
# later, finds it and fails that step too (Session.gather).
_GAVE_UP = b"\xffgave up: process "


class Session:
  """One collective operation (``what``: a preparation or a release of one
  channel group) between ``processes``. Its keys live under a prefix no
  other session uses: the n-th session of ``what`` in every process, since
  every process runs the same collective operations in the same order.
  Every process ends each step of a session alike, also where one arrives
  after another gave up on it, so the n-th session stays the same one in
  every process for the rest of the job (``gather``)."""

  def __init__(self, what: str, processes: Sequence[int], timeout_s: float, advice: str = _SETUP_ADVICE):
    with _sessions_lock:
      _sessions[what] += 1
      self.prefix = f"b12x/{what}/{_sessions[what]}"
    self.what = what
    self.processes = sorted(processes)
    self.me = _process_index()
    self.timeout_s = timeout_s
    self.advice = advice  # what a timeout tells the user to do
    self._deadlines: dict[str, float] = {}  # step -> when its waits end: one bound per step, not per peer

  def _remaining(self, step: str) -> float:
    """Seconds left of ``step``'s bound, which starts at its first wait."""
    deadline = self._deadlines.setdefault(step, time.monotonic() + self.timeout_s)
    return max(0.0, deadline - time.monotonic())

  def publish(self, name: str, value: bytes) -> None:
    _compat.kv_set_bytes(f"{self.prefix}/{name}", value)

  def fetch(self, name: str, step: str) -> bytes:
    """The value a peer published under ``name`` as part of ``step``."""
    value = _compat.kv_get_bytes(f"{self.prefix}/{name}", self._remaining(f"fetch {step}"))
    if value is None:
      raise self._timeout(step, f"{name!r} was not published")
    return value

  def gather(self, step: str, word: bytes) -> dict[int, bytes]:
    """Publishes this process's ``word`` for ``step`` and returns every
    process's (process -> word), waiting at most the timeout for all. A
    process that does not report is named with the last step it waited in.

    Each process's word of a step is written once, by it or, where a peer
    waited in vain, by that peer as ``_GAVE_UP`` (the store takes the first
    write): every process reads the same words, so all get through the
    step or all raise CollectiveTimeoutError, also the late one, and the
    sessions of the processes stay in step (a late process that took a word
    its peer had given up on went on alone, its next sessions paired with
    other ones of its peer, and every later step timed out)."""
    held = _compat.kv_set_first(self._key(step, self.me), word)
    if held is not None and held.startswith(_GAVE_UP):
      raise CollectiveTimeoutError(
          f"b12x_jax: {self.what}: step {step!r} failed in process {self.me}, which arrived after process "
          f"{held[len(_GAVE_UP):].decode()} had given up waiting {self.timeout_s:g} s for it. {self.advice}")
    if held is not None:
      raise ChannelError(f"b12x_jax: {self.what}: this process's word of step {step!r} was already published: two "
                         "sessions of it under one name (one Communicator used from several threads at once?)")
    try:  # only for the diagnosis of a timeout: never fails the step
      _compat.kv_set_bytes(f"{_LAST_STEP}/p{self.me}", f"{self.what} #{self.prefix.rsplit('/', 1)[1]}, step "
                           f"{step!r}".encode(), overwrite=True)
    except RuntimeError:
      pass
    words = {}
    for p in self.processes:
      got = _compat.kv_get_bytes(self._key(step, p), self._remaining(step))
      if got is None:  # its word, had it come just now, else this process's giving up
        got = _compat.kv_set_first(self._key(step, p), _GAVE_UP + str(self.me).encode()) or _GAVE_UP
      if got.startswith(_GAVE_UP):
        last = _compat.kv_try_get_bytes(f"{_LAST_STEP}/p{p}")
        where = "none yet" if last is None else last.decode()
        raise self._timeout(step, f"process {p} did not report (the last b12x_jax step it entered: {where})")
      words[p] = got
    return words

  def _key(self, step: str, process: int) -> str:
    return f"{self.prefix}/{step}/p{process}"

  def verdict(self, step: str, problem: BaseException | None) -> None:
    """The collective end of ``step``: publishes whether this process got
    through it, waits for every other process's word, and raises, the same
    error type on every process, if any failed or did not answer within the
    timeout."""
    kind = "" if problem is None else type(problem).__name__ if isinstance(problem, B12xError) else "TransportError"
    failures: list[tuple[int, str, str]] = []
    for p, word in self.gather(step, f"{kind}\0{problem or ''}".encode()).items():
      kind, _, message = word.decode().partition("\0")
      if kind:
        failures.append((p, kind, message))
    if failures:
      error = {"ChannelError": ChannelError, "GroupUnreachableError": GroupUnreachableError}.get(failures[0][1],
                                                                                                 TransportError)
      by_message: dict[str, list[int]] = {}  # a problem every process saw (a disagreement) is told once
      for p, _, message in failures:
        by_message.setdefault(message, []).append(p)
      text = "; ".join(f"process{'es' if len(ps) > 1 else ''} {', '.join(map(str, ps))}: {message}"
                       for message, ps in by_message.items())
      raise error(f"b12x_jax: {self.what}: step {step!r} failed on {len(failures)} of {len(self.processes)} "
                  f"processes, so every process rolled it back ({text})")

  def _timeout(self, step: str, missing: str) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(f"b12x_jax: {self.what}: step {step!r} timed out after {self.timeout_s:g} s in "
                                  f"process {self.me}: {missing}. {self.advice}")


# Memory a rollback or release could not prove unmapped everywhere (a peer
# timed out): kept alive until exit rather than freed under a peer (C11).
_kept: list = []


def prepare_shared(platform: str, channel: str, partition: str, group_key: str, processes: Sequence[int],
                   ordinals: list[int], options, settings: Settings, setup_timeout_s: float) -> str:
  """Prepares this process's ranks of a channel group that spans
  ``processes`` (``ordinals[r]`` is -1 for a rank another process holds),
  collectively. Where every process holds the same released group for
  these devices and settings, it is reused (``_reuse``); else in three
  steps, each ending with a verdict:

    allocated  allocate, zero-fill and export the local ranks; publish one
               Frame per rank. On failure anywhere: free, raise.
    opened     fetch every remote rank's frame and check, in this order,
               that it agrees on the settings (ChannelError), that it is
               on this host (TransportError: the group spans hosts, and the
               caller may fall back, DESIGN C12) and that its layout agrees
               (ChannelError); then open it. On failure anywhere: close the
               imports, then
    closed     (rollback only) a barrier, so that no process frees memory a
               peer still maps; then free and raise.

  Every process fetches every frame and checks in the same order, so a
  disagreement between any two processes is found by all, as the same
  error (DESIGN C17). A failure leaves no shared-memory name on the host,
  of this process or of a peer that died with its own (``_drop_names``).
  On success the group is installed and handlers find
  it. Each step waits at most ``setup_timeout_s`` for the peers;
  ``options`` are a native ChannelOptions (``_native.channel_options``),
  ``settings`` the Communicator's that peers must share. Returns the name
  every process gives this preparation (for ``publish_records``)."""
  session = Session(f"prepare/{platform}/{channel}/{group_key}", processes, setup_timeout_s)
  if _reuse(session, platform, channel, partition, ordinals, options, settings):
    return session.prefix
  pending, problem = _attempt(lambda: _native.share(platform, channel, partition, ordinals, options, session.prefix))
  own = None
  try:
    if pending is not None:
      layout = tuple(pending.layout())
      for rank, exported in pending.exports().items():
        own = Frame(platform, channel, rank, len(ordinals), session.me, host_id(), build_id(), settings, layout,
                    exported)
        session.publish(f"frame/{rank}", own.encode())
    session.verdict("allocated", problem)
  except BaseException:
    _drop_names(session, platform, ordinals)
    if pending is not None:
      pending.free()  # nothing of it was opened anywhere yet
    raise

  def open_all() -> None:
    peers = {rank: Frame.decode(session.fetch(f"frame/{rank}", "opened"))
             for rank, ordinal in enumerate(ordinals) if ordinal < 0}
    for rank, peer in peers.items():
      own.check_peer(peer, rank)
    hosts = {f.process: f.host for f in (own, *peers.values())}
    if len(set(hosts.values())) > 1:
      where = ", ".join(f"process {p} on {h!r}" for p, h in sorted(hosts.items()))
      raise GroupUnreachableError(f"b12x_jax: channel {channel!r}: the device group spans hosts ({where}), and CUDA IPC "
                           f"and shared memory reach only the devices of one host; use an axis whose devices "
                           f"sit on one host for b12x")
    for rank, peer in peers.items():
      own.check_layout(peer, rank)
      _native.open_peer(pending, rank, peer.payload)

  _, problem = _attempt(open_all)
  try:
    session.verdict("opened", problem)
  except BaseException:
    pending.drop_names()  # at once: a peer that times out below keeps the memory, never its name
    _drop_names(session, platform, ordinals)
    pending.close_imports()
    try:
      session.verdict("closed", None)
    except CollectiveTimeoutError:
      _kept.append(pending)  # a peer may still map it
      raise
    pending.free()
    raise
  pending.install()
  return session.prefix


def _reuse(session: Session, platform: str, channel: str, partition: str, ordinals: list[int], options,
           settings: Settings) -> bool:
  """Reuses a released group where every process holds the same one for
  these devices and options (ffi/registry.h reusable) and has the same
  settings: each resets its own ranks, then a verdict, so no peer writes
  into memory not yet reset; the group serves handlers again, under
  ``channel``. False, with nothing changed, where they do not all agree
  (also where one failed to reset): the caller allocates anew, and its
  steps report a disagreement on the settings."""
  candidate, _ = _attempt(lambda: _native.reusable(platform, channel, partition, ordinals, options))
  word = f"{candidate or ''}\0{settings!r}".encode()
  words = set(session.gather("reusable", word).values())  # every process takes part, with or without a candidate
  if not candidate or words != {word}:
    return False
  revived, problem = _attempt(lambda: _native.revive(platform, candidate, channel))
  if problem is None and not revived:
    problem = TransportError(f"b12x_jax: channel {channel!r}: released memory is still busy")
  try:
    session.verdict("reset", problem)
  except B12xError as e:  # a timeout too: the group revived here serves no channel
    if revived:
      _native.retire(platform, candidate)
    if isinstance(e, (ChannelError, TransportError)):
      return False
    raise
  return True


# How long a failed preparation looks for a peer's frame to unlink its name.
_NAME_LOOKUP_S = 0.1


def _drop_names(session: Session, platform: str, ordinals: list[int]) -> None:
  """Unlinks the shared-memory names of every remote rank that published
  its frame in ``session``: a peer that died part-way cannot unlink its
  own. (CUDA IPC handles have no name: they die with their process.)"""
  if platform != "cpu":
    return
  for rank, ordinal in enumerate(ordinals):
    if ordinal >= 0:
      continue
    data = _compat.kv_get_bytes(f"{session.prefix}/frame/{rank}", _NAME_LOOKUP_S)
    if data is not None:
      try:
        _native.unlink_export(platform, Frame.decode(data).payload)
      except ChannelError:  # not a frame of ours: nothing of ours to unlink
        pass


def publish_records(preparation: str, kind: str, records: dict[int, bytes]) -> None:
  """Publishes each local rank's record of ``kind`` (rank -> bytes) for the
  ``preparation`` prepare_shared named; once per preparation and kind."""
  for rank, record in records.items():
    _compat.kv_set_bytes(f"{preparation}/{kind}/{rank}", record)


def fetch_records(preparation: str, kind: str, ranks: Sequence[int], timeout_s: float) -> dict[int, bytes]:
  """The records of ``kind`` that the processes of ``ranks`` published for
  ``preparation``, waiting up to ``timeout_s`` for all."""
  out = {}
  deadline = time.monotonic() + timeout_s
  for rank in ranks:
    record = _compat.kv_get_bytes(f"{preparation}/{kind}/{rank}", max(0.0, deadline - time.monotonic()))
    if record is None:
      raise CollectiveTimeoutError(
          f"b12x_jax: {preparation}: rank {rank}'s {kind} was not published within {timeout_s:g} s: its process "
          f"did not lower the same program (every process must lower the same programs with the same "
          f"Communicator settings), or is slow (raise Communicator(setup_timeout_s=...))")
    out[rank] = record
  return out


def release_shared(platform: str, channel: str, groups: list[tuple[str, tuple[int, ...]]], processes: Sequence[int],
                   timeout_s: float) -> None:
  """Releases ``groups`` ((partition, ordinals) each) of ``channel`` on
  ``platform`` in this process, collectively with ``processes``: a verdict
  once every process stopped issuing work on the channel, then each takes
  its groups out of use. Nothing is unmapped or freed: a cached executable
  or CUDA graph of any process may still point at the memory, its own or a
  peer's (DESIGN C16); a later preparation of the same devices and
  settings reuses it (``_reuse``)."""
  session = Session(f"release/{platform}/{channel}", processes, timeout_s)
  try:
    session.verdict("drained", None)
  finally:
    _native.release(platform, channel, groups)


def _attempt(fn):
  """(fn(), None), or (None, the exception) for any Exception: a failing
  step must still reach its verdict, or the peers would wait for nothing."""
  try:
    return fn(), None
  except Exception as e:  # noqa: BLE001 - reported through the verdict
    return None, e


def _process_index() -> int:
  import jax
  return jax.process_index()
