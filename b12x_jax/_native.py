"""The bridge to the native module ``b12x_jax._b12x``: FFI target
registration and the preparation calls, with native errors turned into
b12x_jax errors."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time

import jax

from b12x_jax import _b12x, _compat
from b12x_jax.errors import ChannelError, CollectiveTimeoutError, GroupUnreachableError, TransportError


def ffi_api_mismatch(built: tuple[int, int], built_jaxlib: str, runtime: tuple[int, int] | None,
                     runtime_jaxlib: str) -> str | None:
  """Why XLA would refuse this extension's FFI handlers, or None: a runtime
  takes handlers of its own FFI API major version and a minor up to its own
  (docs/DESIGN.md, "Build"). ``runtime`` None (no headers to read) passes."""
  if runtime is None or (built[0] == runtime[0] and built[1] <= runtime[1]):
    return None
  return (f"b12x_jax: the extension was built against jaxlib {built_jaxlib} (XLA FFI API {built[0]}.{built[1]}), "
          f"which this jaxlib {runtime_jaxlib} (XLA FFI API {runtime[0]}.{runtime[1]}) refuses. Reinstall b12x_jax "
          f"with build isolation (pip install --force-reinstall --no-cache-dir .), which builds against the oldest "
          f"supported jaxlib's headers that every supported jaxlib accepts, or build it with "
          f"--no-build-isolation in a venv with this jaxlib.")


def _runtime_ffi_api() -> tuple[int, int] | None:
  """The XLA FFI API version of the running jaxlib, from the C API header it
  ships; None where it ships none."""
  import jaxlib.version
  header = os.path.join(os.path.dirname(jaxlib.version.__file__), "include", "xla", "ffi", "api", "c_api.h")
  try:
    with open(header, encoding="utf-8") as f:
      text = f.read()
  except OSError:
    return None
  found = [re.search(rf"^#define XLA_FFI_API_{part} (\d+)", text, re.M) for part in ("MAJOR", "MINOR")]
  return None if None in found else (int(found[0].group(1)), int(found[1].group(1)))


def _check_ffi_api() -> None:
  import jaxlib.version
  problem = ffi_api_mismatch(tuple(_b12x.ffi_api_version()), _b12x.built_jaxlib, _runtime_ffi_api(),
                             jaxlib.version.__version__)
  if problem:
    raise ImportError(problem)


_check_ffi_api()
# What the native layer is built with (ffi/channel.h, ffi/all_reduce.h):
# the ranks of a channel, its largest grid, the most blocks a row of the
# Triton fused op spans, the payload granularity, and the all_reduce
# algorithms' codes (the custom call's `algorithm`).
MAX_RANKS: int = _b12x.constants["max_ranks"]
MAX_BLOCKS: int = _b12x.constants["max_blocks"]
MAX_ROW_SPLIT: int = _b12x.constants["max_row_split"]
PACK_BYTES: int = _b12x.constants["pack_bytes"]
MAX_CAPACITY_BYTES: int = _b12x.constants["max_capacity_bytes"]
ALGORITHMS: dict[str, int] = dict(_b12x.constants["algorithms"])
# The protocol this build speaks, as one word (ffi/bindings.cc protocol_fingerprint).
PROTOCOL: int = _b12x.protocol
_registered = False
_register_lock = threading.Lock()
# Device groups whose peer access passed its probe, per process.
_probed: set[tuple[int, ...]] = set()


def platforms() -> tuple[str, ...]:
  """Platforms this build has a backend for."""
  return ("cpu", "cuda") if _b12x.has_cuda() else ("cpu",)


def ensure_registered() -> None:
  """Registers the FFI targets with XLA, once, after the backends exist
  (registering before can break the CPU backend's start: docs/DESIGN.md, "Build")."""
  global _registered
  with _register_lock:
    if _registered:
      return
    jax.devices()  # creates the backends
    for platform, targets in _b12x.handlers().items():
      if platform == "CUDA" and not _has_gpu_backend():
        continue
      for name, capsule in targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
    for backend in ("cpu", "gpu"):  # a call's placement compares them (ffi/channel.h Placement)
      try:
        devices = jax.local_devices(backend=backend)
      except RuntimeError:
        continue
      for device in devices:
        platform = _compat.platform_of([device])  # "cuda" for a CUDA device, whose Device.platform is "gpu"
        if platform in platforms():
          _b12x.set_device_id(platform, _compat.device_ordinal(device), device.id)
    _registered = True


def _has_gpu_backend() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def channel_options(*, capacity_bytes: int, lamport_bytes: int, timeout_s: float, setup_timeout_s: float,
                    max_blocks: int | None, poison_outputs: bool, loopback: bool = False):
  """The native ChannelOptions every transport is prepared with. max_blocks
  None means "as many as fit"; a channel's first call waits up to
  setup_timeout_s for its peers; ``loopback`` makes a group of one device
  its own peer (docs/DESIGN.md, "Loopback")."""
  options = _b12x.ChannelOptions()
  options.capacity_bytes = capacity_bytes
  options.lamport_bytes = lamport_bytes
  options.timeout_s = timeout_s
  options.setup_timeout_s = setup_timeout_s
  options.max_blocks = max_blocks or 0
  options.poison_outputs = poison_outputs
  options.loopback = loopback
  return options


@contextlib.contextmanager
def _native_errors(what: str):
  """Native failures as b12x_jax errors: invalid settings (nanobind maps
  std::invalid_argument to ValueError) as ChannelError, the rest as
  TransportError saying ``what`` failed."""
  try:
    yield
  except ValueError as e:
    raise ChannelError(str(e)) from None
  except RuntimeError as e:
    if isinstance(e, TransportError):
      raise
    raise TransportError(f"b12x_jax: {what} failed: {e}") from None


def prepare(platform: str, channel: str, partition: str, ordinals: list[int], options) -> None:
  """Allocates ``channel`` for one group with ``options`` (channel_options).
  A CUDA group's peer access is probed first (once per group); a failed
  probe raises GroupUnreachableError."""
  with _native_errors(f"preparing channel {channel!r} on {platform} devices {ordinals}"):
    if platform == "cpu":
      _b12x.prepare_host(channel, partition, ordinals, options)
    elif platform == "cuda":
      group = tuple(ordinals)
      if group not in _probed:
        problem = _b12x.probe_peer_access(ordinals)
        if problem:
          raise GroupUnreachableError(f"peer access between GPUs {ordinals} does not work: {problem}")
        _probed.add(group)
      _b12x.prepare_cuda(channel, partition, ordinals, options)
    else:
      raise TransportError(f"no b12x backend for platform {platform!r}")


def shutdown_host_progress(seconds: float) -> bool:
  """At exit: waits, at most ``seconds``, for the host backend's queued
  calls and completions, then joins its progress thread; True if it was
  idle. Host calls submitted afterwards fail at once."""
  return bool(_b12x.shutdown_host_progress(seconds))


def payload_limits(options) -> tuple[int, int]:
  """(capacity_bytes, lamport_window) of a channel with ``options``: a call
  stages at most the first and takes the Lamport exchange up to the second
  (0: never), at trace time and in every handler (ffi/channel.h
  ChannelView)."""
  capacity, window = _b12x.payload_limits(options)
  return int(capacity), int(window)


def lamport_cell_bytes(options, blocks: int) -> int:
  """One Lamport cell of a channel with ``options`` and ``blocks`` blocks,
  as the native layer lays it out (ffi/registry.cc base_view: the window
  clamped to the capacity, split over the blocks)."""
  return int(_b12x.lamport_cell_bytes(options, blocks))


def dcp_lamport_plan(cell_bytes: int, max_blocks: int, batch: int, heads: int, world: int, row_bytes: int, *,
                     dtype: str, site: int, base2: bool) -> tuple[int, int, tuple[int, int, int, int]]:
  """(grid, rows per block, tag) of a dcp_a2a call of out [batch, heads,
  row_bytes] of ``dtype`` at ``site`` (lse in base 2 where ``base2``) over
  ``world`` ranks in Lamport cells of ``cell_bytes`` in ``max_blocks``
  blocks, as both kernels plan it (ffi/dcp.h plan_dcp_lamport); grid 0
  where the rows do not fit."""
  grid, per_block, tag = _b12x.dcp_lamport_plan(cell_bytes, max_blocks, batch, heads, world, row_bytes, dtype, site,
                                                base2)
  return int(grid), int(per_block), tuple(int(t) for t in tag)


def rows_tag(rows: int, row_bytes: int, grid: int, *, dtype: str, site: int) -> tuple[int, int, int, int]:
  """The call tag of the fused op on ``rows`` rows of ``row_bytes`` of
  ``dtype`` over ``grid`` blocks at ``site`` (ffi/rmsnorm.h RowsPlan::tag)."""
  return tuple(int(t) for t in _b12x.rows_tag(rows, row_bytes, grid, dtype, site))


def name_site(site: int, name: str) -> None:
  """Names call site ``site`` in this process's error messages."""
  _b12x.name_site(site, name)


def dcp_tag_limits() -> tuple[int, int]:
  """(heads, row bytes): the largest H and row of out [B, H, D] a dcp_a2a
  call's tag carries (ffi/dcp.h dcp_tag_algorithm); larger calls take
  all_to_all."""
  heads, row_bytes = _b12x.dcp_tag_limits()
  return int(heads), int(row_bytes)


def share(platform: str, channel: str, partition: str, ordinals: list[int], options, preparation: str):
  """Allocates, zero-fills and exports this process's ranks of a channel
  shared with other processes (``ordinals[r]`` is -1 for a rank another
  process holds): POSIX shared memory on CPU, CUDA IPC on GPUs, as the
  memory of ``preparation`` (the name every process gives it). Returns the
  native PendingGroup that rendezvous steps drive to install or free."""
  with _native_errors(f"allocating channel {channel!r} on {platform} devices {ordinals} for other processes"):
    if platform == "cpu":
      return _b12x.share_host(channel, partition, ordinals, options, preparation)
    if platform == "cuda":
      return _b12x.share_cuda(channel, partition, ordinals, options, preparation)
    raise TransportError(f"no b12x backend for platform {platform!r}")


def reusable(platform: str, channel: str, partition: str, ordinals: list[int], options) -> str:
  """The preparation of a released group that a new preparation of
  ``channel`` on these devices and options can reuse ('' if none): of the
  channel itself first, else of another name (ffi/registry.h reusable)."""
  with _native_errors(f"looking for released memory of channel {channel!r}"):
    return str(_b12x.reusable(platform, channel, partition, ordinals, options))


def revive(platform: str, preparation: str, channel: str) -> bool:
  """Puts the released group of ``preparation`` back into use as
  ``channel``, reset; False if it cannot (busy)."""
  with _native_errors(f"resetting released memory for channel {channel!r}"):
    return bool(_b12x.revive(platform, preparation, channel))


def retire(platform: str, preparation: str) -> None:
  """Takes a group revived by a preparation that then failed out of use."""
  _b12x.retire(platform, preparation)


def unlink_export(platform: str, exported: bytes) -> None:
  """Unlinks the host-wide name in a peer's export, if it has one."""
  _b12x.unlink_export(platform, exported)


def open_peer(pending, rank: int, exported: bytes) -> None:
  """Maps remote rank ``rank``'s memory from its export into ``pending``."""
  try:
    pending.open(rank, exported)
  except (RuntimeError, ValueError) as e:
    raise TransportError(f"b12x_jax: opening rank {rank}'s memory failed: {e}") from None


def await_even_refusals(op: str, platform: str, channel: str, partition: str, ordinals: list[int],
                        timeout_s: float) -> None:
  """Waits until this process's host devices of a group about to be
  prepared have had as many calls of ``channel`` over ``partition``
  refused as not prepared as each other (ffi/registry.h refusals): a call
  refused on one device first may still be on its way to the others, and a
  prepared channel would serve it there, beside their next call
  (docs/DESIGN.md, "Lifetime"). Polls every millisecond; after
  ``timeout_s`` raises CollectiveTimeoutError naming the devices behind and
  forgives them their present counts, so that the next preparation goes
  ahead whether the call reaches them later or never (its execution may
  have failed before it)."""
  deadline = time.monotonic() + timeout_s
  while True:
    even, calls = _b12x.refusals(platform, channel, partition, ordinals)
    if even:
      return
    if time.monotonic() > deadline:
      _b12x.forgive_refusals(platform, channel, partition, ordinals)
      refused = {o: n for o, n in zip(ordinals, calls) if o >= 0}  # remote ranks: their process counts them
      behind = sorted(o for o, n in refused.items() if n < max(refused.values()))
      raise CollectiveTimeoutError(
          f"b12x_jax.{op}: channel {channel!r}: a call refused as not prepared on some of its devices had not "
          f"reached devices {behind} after {timeout_s:g} s (refused calls: "
          f"{', '.join(f'device {o}: {n}' for o, n in sorted(refused.items()))}); preparing now would let it run "
          f"there beside the next call. Block on every shard of the channel's earlier results (each array's "
          f"addressable_shards, the failed ones too), then prepare again: it goes ahead")
    time.sleep(0.001)


def release(platform: str, channel: str, groups: list[tuple[str, tuple[int, ...]]]) -> None:
  """Takes the channel's ``groups`` ((partition, ordinals) each: a
  Communicator's own) out of use once this process's calls queued on them
  are done (CUDA groups have their kernels on the device; host groups wait,
  bounded, for the progress thread). Their memory stays for the life of the
  process, since a cached executable or CUDA graph may still point at it
  (DESIGN C16); the next preparation of the same group reuses it.
  CollectiveTimeoutError if calls are still queued after the bound."""
  try:
    _b12x.release(platform, channel, [(partition, list(ordinals)) for partition, ordinals in groups])
  except RuntimeError as e:
    raise CollectiveTimeoutError(str(e)) from None


def stats(platform: str, channel: str, ordinal: int) -> dict:
  try:
    return dict(_b12x.stats(platform, channel, ordinal))
  except ValueError as e:
    raise ChannelError(str(e)) from None


def start_counters(platform: str, channel: str, calls: int) -> None:
  """Test hook (docs/DESIGN.md, "Wrap"): this process's ranks of every group
  of ``channel`` start as if ``calls`` calls had run (counters, parity flags,
  Lamport call count and buffer)."""
  with _native_errors(f"starting the counters of channel {channel!r} at {calls}"):
    _b12x.start_counters(platform, channel, calls)


def kernel_view(platform: str, channel: str, partition: str, ordinal: int, nbytes: int, *, dtype: str,
                site: int) -> dict:
  """What a kernel outside the native layer needs for an all_reduce of
  ``nbytes`` of ``dtype`` at ``site`` on device ``ordinal``'s rank of the
  prepared channel: device addresses (valid for the life of the process,
  DESIGN C16), the preparation's generation, the layout, the plan and its
  tag, the protocol's constants (ffi/bindings.cc kernel_view)."""
  with _native_errors(f"reading the kernel view of channel {channel!r} on device {ordinal}"):
    return dict(_b12x.kernel_view(platform, channel, partition, ordinal, nbytes, dtype, site))


def pending_errors() -> list[str]:
  """The recorded timeouts of this process's ranks, once the host backend's
  calls queued so far have ended (bounded: each ends within its timeout)."""
  return list(_b12x.pending_errors())
