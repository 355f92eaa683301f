"""Exchanges between the processes of one channel group, through the
``jax.distributed`` key-value store (DESIGN §3, C4, C11).

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
import struct
import threading
from collections.abc import Sequence

from b12x_jax import _compat, _native
from b12x_jax.errors import B12xError, ChannelError, CollectiveTimeoutError, TransportError

FRAME_MAGIC = b"B12X"
FRAME_VERSION = 1
# magic, version, platform, rank, world, block_bytes, lamport_block_bytes,
# max_blocks, channel name length, payload length; then the name (UTF-8)
# and the payload. Little-endian, no padding: the same bytes on every host.
_HEADER = struct.Struct("<4sHBxiiQQiHI")
_PLATFORMS = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Frame:
  """What rank ``rank`` of a channel publishes for its peers."""
  platform: str
  channel: str
  rank: int
  world: int
  layout: tuple[int, int, int]  # (block_bytes, lamport_block_bytes, max_blocks): equal on every rank
  payload: bytes

  def encode(self) -> bytes:
    name = self.channel.encode()
    return _HEADER.pack(FRAME_MAGIC, FRAME_VERSION, _PLATFORMS.index(self.platform), self.rank, self.world,
                        *self.layout, len(name), len(self.payload)) + name + self.payload

  @classmethod
  def decode(cls, data: bytes) -> Frame:
    """The frame in ``data``; ChannelError if it is not a frame of this version."""
    if len(data) < _HEADER.size or data[:4] != FRAME_MAGIC:
      raise ChannelError("b12x_jax: a peer published something that is not a b12x_jax frame")
    magic, version, platform, rank, world, block, lamport, blocks, name_len, payload_len = _HEADER.unpack_from(data)
    del magic
    if version != FRAME_VERSION:
      raise ChannelError(f"b12x_jax: a peer speaks frame version {version}, this process {FRAME_VERSION}: run the "
                         "same b12x_jax in every process")
    if len(data) != _HEADER.size + name_len + payload_len or platform >= len(_PLATFORMS):
      raise ChannelError("b12x_jax: a peer's frame is truncated or malformed")
    name = data[_HEADER.size:_HEADER.size + name_len].decode()
    return cls(_PLATFORMS[platform], name, rank, world, (block, lamport, blocks), data[_HEADER.size + name_len:])

  def check_peer(self, peer: Frame, rank: int) -> None:
    """Raises ChannelError naming the field where ``peer``, published as
    rank ``rank``, disagrees with this rank's frame."""
    for field, want, got in [("rank", rank, peer.rank), ("platform", self.platform, peer.platform),
                             ("channel", self.channel, peer.channel), ("world", self.world, peer.world),
                             ("layout (block_bytes, lamport_block_bytes, max_blocks)", self.layout, peer.layout)]:
      if want != got:
        raise ChannelError(f"b12x_jax: channel {self.channel!r}: rank {rank}'s {field} is {got!r}, rank "
                           f"{self.rank}'s is {want!r}; make the Communicator the same in every process")


_sessions: collections.Counter[str] = collections.Counter()
_sessions_lock = threading.Lock()


class Session:
  """One collective operation (``what``: a preparation or a release of one
  channel group) between ``processes``. Its keys live under a prefix no
  other session uses: the n-th session of ``what`` in every process, since
  every process runs the same collective operations in the same order."""

  def __init__(self, what: str, processes: Sequence[int], timeout_s: float):
    with _sessions_lock:
      _sessions[what] += 1
      self.prefix = f"b12x/{what}/{_sessions[what]}"
    self.what = what
    self.processes = sorted(processes)
    self.me = _process_index()
    self.timeout_s = timeout_s

  def publish(self, name: str, value: bytes) -> None:
    _compat.kv_set_bytes(f"{self.prefix}/{name}", value)

  def fetch(self, name: str, step: str) -> bytes:
    """The value a peer published under ``name`` as part of ``step``."""
    value = _compat.kv_get_bytes(f"{self.prefix}/{name}", self.timeout_s)
    if value is None:
      raise self._timeout(step, f"{name!r} was not published")
    return value

  def verdict(self, step: str, problem: BaseException | None) -> None:
    """The collective end of ``step``: publishes whether this process got
    through it, waits for every other process's word, and raises, the same
    error type on every process, if any failed or did not answer within the
    timeout."""
    kind = "" if problem is None else type(problem).__name__ if isinstance(problem, B12xError) else "TransportError"
    self.publish(f"{step}/p{self.me}", f"{kind}\0{problem or ''}".encode())
    failures: list[tuple[int, str, str]] = []
    for p in self.processes:
      word = _compat.kv_get_bytes(f"{self.prefix}/{step}/p{p}", self.timeout_s)
      if word is None:
        raise self._timeout(step, f"process {p} did not report")
      kind, _, message = word.decode().partition("\0")
      if kind:
        failures.append((p, kind, message))
    if failures:
      error = {"ChannelError": ChannelError}.get(failures[0][1], TransportError)
      text = "; ".join(f"process {p}: {message}" for p, _, message in failures)
      raise error(f"b12x_jax: {self.what}: step {step!r} failed on {len(failures)} of {len(self.processes)} "
                  f"processes, so every process rolled it back ({text})")

  def _timeout(self, step: str, missing: str) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(
        f"b12x_jax: {self.what}: step {step!r} timed out after {self.timeout_s:g} s in process {self.me}: "
        f"{missing}. Preparing and releasing a channel shared between processes are collective: every "
        f"process of the group must make the same calls (Communicator.prepare / release / close, or lower "
        f"the same program); raise Communicator(setup_timeout_s=...) if a process is only slow.")


# Memory a rollback or release could not prove unmapped everywhere (a peer
# timed out): kept alive until exit rather than freed under a peer (C11).
_kept: list = []


def prepare_shared(platform: str, channel: str, group_key: str, processes: Sequence[int], ordinals: list[int],
                   options, setup_timeout_s: float) -> None:
  """Prepares this process's ranks of a channel group that spans
  ``processes`` (``ordinals[r]`` is -1 for a rank another process holds),
  collectively, in three steps, each ending with a verdict:

    allocated  allocate, zero-fill and export the local ranks; publish one
               Frame per rank. On failure anywhere: free, raise.
    opened     fetch every remote rank's frame, check it agrees, open it.
               On failure anywhere: close the imports, then
    closed     (rollback only) a barrier, so that no process frees memory a
               peer still maps; then free and raise.

  On success the group is installed and handlers find it. Each step waits
  at most ``setup_timeout_s`` for the peers; ``options`` are a
  native ChannelOptions (``_native.channel_options``)."""
  session = Session(f"prepare/{platform}/{channel}/{group_key}", processes, setup_timeout_s)
  pending, problem = _attempt(lambda: _native.share(platform, channel, ordinals, options))
  own = None
  try:
    if pending is not None:
      layout = tuple(pending.layout())
      for rank, exported in pending.exports().items():
        own = Frame(platform, channel, rank, len(ordinals), layout, exported)
        session.publish(f"frame/{rank}", own.encode())
    session.verdict("allocated", problem)
  except BaseException:
    if pending is not None:
      pending.free()  # nothing of it was opened anywhere yet
    raise

  def open_all() -> None:
    for rank, ordinal in enumerate(ordinals):
      if ordinal < 0:
        peer = Frame.decode(session.fetch(f"frame/{rank}", "opened"))
        own.check_peer(peer, rank)
        _native.open_peer(pending, rank, peer.payload)

  _, problem = _attempt(open_all)
  try:
    session.verdict("opened", problem)
  except BaseException:
    pending.close_imports()
    try:
      session.verdict("closed", None)
    except CollectiveTimeoutError:
      _kept.append(pending)  # a peer may still map it
      raise
    pending.free()
    raise
  pending.install()


def release_shared(platform: str, channel: str, processes: Sequence[int], timeout_s: float) -> None:
  """Releases every group of ``channel`` on ``platform`` in this process,
  collectively with ``processes``: a verdict once every process stopped
  issuing work on the channel, then each takes it out of use. Nothing is
  unmapped or freed: a cached executable or CUDA graph of any process may
  still point at the memory, its own or a peer's (DESIGN C16); a later
  preparation of the name allocates and exchanges anew."""
  session = Session(f"release/{platform}/{channel}", processes, timeout_s)
  try:
    session.verdict("drained", None)
  finally:
    _native.release(platform, channel)


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
