"""What the examples share: running as several jax.distributed processes on
this host, one device (one b12x rank) each (the way a production server runs
one process per GPU, and the one-GPU rig: every process on GPU 0, over CUDA
IPC; start MPS first for speed), a progress report and a bar chart."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
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


def _launch(n: int) -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  command = [sys.executable, *sys.argv, "--coordinator", f"127.0.0.1:{port}", "--process-id"]
  procs = [subprocess.Popen(command + [str(i)], stdout=None if i == 0 else subprocess.DEVNULL, env=os.environ)
           for i in range(n)]
  failed_at = None
  while any(p.poll() is None for p in procs):
    if failed_at is None and any(p.poll() for p in procs):
      failed_at = time.monotonic()
    if failed_at is not None and time.monotonic() - failed_at > _GRACE_S:
      for p in procs:
        p.kill()
    time.sleep(0.2)
  codes = [p.returncode for p in procs]
  return next((code for code in codes if code), 0)


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
