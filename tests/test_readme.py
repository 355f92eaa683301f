"""The README's Python blocks run as written, in order, as one script on 2
emulated CPU devices (what a new user meets first), and name every b12x
custom call target for jax.export."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import b12x_jax.ops.all_reduce
import b12x_jax.ops.dcp_a2a
import b12x_jax.ops.residual_rmsnorm

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def _python_blocks() -> list[str]:
  with open(README, encoding="utf-8") as f:
    return re.findall(r"^```python\n(.*?)^```$", f.read(), flags=re.S | re.M)


def test_readme_python_blocks_run_on_two_cpu_devices():
  pytest.importorskip("flatbuffers", reason="the export block serializes: jax.export needs the flatbuffers package")
  blocks = _python_blocks()
  assert len(blocks) >= 2, "the README shows the API and jax.export"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  proc = subprocess.run([sys.executable, "-c", "\n".join(blocks)], capture_output=True, text=True, env=env,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "\n()\n" in proc.stdout, proc.stdout  # the export's ordered effects: none


def test_readme_export_block_disables_the_check_of_every_b12x_target():
  export_block = next(b for b in _python_blocks() if "jax.export" in b)
  named = set(re.findall(r'"(b12x_\w+)"', export_block))
  targets = {b12x_jax.ops.all_reduce.all_reduce_p.name, b12x_jax.ops.dcp_a2a.dcp_a2a_p.name,
             b12x_jax.ops.residual_rmsnorm.residual_rmsnorm_p.name}
  assert named == targets
