"""What the examples share: running as several jax.distributed processes on
this host, one device (one b12x rank) each (the way a production server runs
one process per GPU, and the one-GPU rig: every process on GPU 0, over CUDA
IPC; start MPS first for speed), a progress report and a bar chart."""

from __future__ import annotations

import argparse
import atexit
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

# A process that fails makes its peers fail within their timeouts; past this
# the launcher stops whoever is left.
_GRACE_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--processes", type=int, default=1,
                      help="run as this many jax.distributed processes on this host, one device each "
                           "(--devices must equal it); the script starts them and shows process 0's output")
  parser.add_argument("--shared-gpu", action="store_true",
                      help="with --processes: every process takes GPU 0 (the one-GPU rig), else process i "
                           "takes GPU i; jax.lax collectives (NCCL) cannot run there, so only b12x is timed")
  parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)  # set by the launcher
  parser.add_argument("--coordinator", help=argparse.SUPPRESS)


def emulate_cpu_devices(count: int) -> None:
  """Asks XLA for ``count`` emulated CPU devices (used only where fewer GPUs
  are present), beside what XLA_FLAGS already holds (a dump directory, say);
  a device count set there is kept. Call before importing jax."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def host_devices(args) -> int:
  """The CPU devices this process emulates: its share of --devices."""
  return 1 if args.processes > 1 else max(args.devices, 2)


def launch_or_join(args) -> None:
  """With --processes N > 1: called without --process-id, starts N copies of
  this script (process ids 0..N-1), shows process 0's output and exits with
  the first non-zero status among them; in a copy, joins jax.distributed.
  Call before anything else uses JAX."""
  if args.processes == 1:
    return
  if args.devices != args.processes:
    sys.exit(f"--devices={args.devices} must equal --processes={args.processes} (one device per process)")
  if args.process_id is None:
    sys.exit(_launch(args.processes))
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # psum across CPU processes
  jax.distributed.initialize(args.coordinator, num_processes=args.processes, process_id=args.process_id,
                             local_device_ids=[0 if args.shared_gpu else args.process_id],
                             initialization_timeout=120)
  atexit.register(_shut_down)  # runs before JAX's own exit handler, registered earlier


def _shut_down() -> None:
  """At exit, in an order that logs no error: b12x's channels are released
  collectively while the key-value store is up, then every process leaves
  jax.distributed together (its shutdown is a barrier), so no process
  watches a coordinator that is gone."""
  import jax

  import b12x_jax
  b12x_jax.get_communicator().close()
  jax.distributed.shutdown()


# What jax.distributed and Gloo log on every run, which says nothing about the example.
_NOISE = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks|WatchTasksAsync failed|"
                    r"Additional GRPC error information|:UNAVAILABLE:failed to connect")


def _forward(stream, out) -> None:
  for line in stream:
    if not _NOISE.search(line):
      out.write(line)
      out.flush()


def _launch(n: int) -> int:
  """Starts the n processes; shows process 0's output, without the noise,
  and another process's stderr only if it failed."""
  from b12x_jax.rendezvous import coordinator_port

  port = coordinator_port()
  command = [sys.executable, *sys.argv, "--coordinator", f"127.0.0.1:{port}", "--process-id"]
  logs = [tempfile.TemporaryFile("w+") for _ in range(1, n)]
  env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # process 0's lines in the order it wrote them
  procs = [subprocess.Popen(command + ["0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)]
  procs += [subprocess.Popen(command + [str(i)], stdout=subprocess.DEVNULL, stderr=logs[i - 1], env=env)
            for i in range(1, n)]
  forwards = [threading.Thread(target=_forward, args=(stream, out), daemon=True)
              for stream, out in ((procs[0].stdout, sys.stdout), (procs[0].stderr, sys.stderr))]
  for thread in forwards:
    thread.start()
  failed_at = None
  while any(p.poll() is None for p in procs):
    if failed_at is None and any(p.poll() for p in procs):
      failed_at = time.monotonic()
    if failed_at is not None and time.monotonic() - failed_at > _GRACE_S:
      for p in procs:
        p.kill()
    time.sleep(0.2)
  for thread in forwards:
    thread.join()
  for i, (proc, log) in enumerate(zip(procs[1:], logs), start=1):
    if proc.returncode:
      log.seek(0)
      print(f"process {i} exited {proc.returncode}:\n{log.read()[-3000:]}", file=sys.stderr)
  codes = [p.returncode for p in procs]
  return next((code for code in codes if code), 0)


def path_label(kind: str, decisions) -> tuple[str, str | None]:
  """The label of the row (or column) of a b12x variant ``kind`` whose calls
  made ``decisions``, by the paths they really took: ``kind`` where every
  call took b12x; else the paths taken, marked with a star, and the note
  that says why (the operator's B12X_JAX_POLICY=psum, a call outside the
  window)."""
  paths = sorted({d.path for d in decisions})
  if paths == ["b12x"]:
    return kind, None
  other = next(d for d in decisions if d.path != "b12x")
  return "+".join(paths) + "*", f"* {kind}'s b12x_jax calls took the {'/'.join(paths)} path: {other.reason}"


class Progress:
  """A one-line bar on stderr when it is a terminal, else one line per step
  with the seconds since the start (a log then shows where a run spends its
  time, or where it stopped)."""

  def __init__(self, total: int):
    self.total, self.done, self.start = total, 0, time.monotonic()

  def step(self, label: str) -> None:
    self.done += 1
    if sys.stderr.isatty():
      bar = "#" * (30 * self.done // self.total)
      end = "\n" if self.done == self.total else ""
      print(f"\r  [{bar:30s}] {self.done}/{self.total} {label:40s}", end=end, file=sys.stderr, flush=True)
    else:
      print(f"  [{self.done}/{self.total}, {time.monotonic() - self.start:.1f} s] {label}", file=sys.stderr, flush=True)


def bar_chart(path: str, bars: dict[str, tuple[str, str, float]], ylabel: str, title: str,
              notes: dict[str, str] | None = None) -> None:
  """A PNG at ``path`` of one bar per entry of ``bars`` (key -> (label,
  color, value)), each with its ``notes`` line above it; or a line saying
  none is written where matplotlib is not importable."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(f"--plot {path}: matplotlib is not importable; no plot written")
    return
  fig, ax = plt.subplots(figsize=(6, 3.5))
  drawn = ax.bar([label for label, _, _ in bars.values()], [value for _, _, value in bars.values()],
                 color=[color for _, color, _ in bars.values()])
  for key, bar in zip(bars, drawn):
    if notes and key in notes:
      ax.annotate(notes[key], (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                  fontsize=8)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"plot written to {path}")
