"""What a new user meets first in the README works as written: the two set-up
commands are its first two bash blocks, its first Python block (the short
example) runs alone on CPU with no flags from the environment, all its Python
blocks run in order as one script, and the export block names every b12x
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
ROOT = os.path.join(os.path.dirname(__file__), os.pardir)

# The first two commands of the README, in this order (CI runs them).
SETUP = ('PYENV_VERSION=3.12.1 python3.12 -m venv .venv && . .venv/bin/activate && '
         'pip install "jax==0.11.2" -e ".[test]" && python examples/quickstart.py')
TESTS = "python -m pytest tests"

# What the first screen holds, in this order, before the API reference.
FIRST_SECTIONS = ["## Install", "## Example", "## What was measured, where", "## Limits", "## API reference"]


def _readme() -> str:
  with open(README, encoding="utf-8") as f:
    return f.read()


def _blocks(language: str) -> list[str]:
  return re.findall(rf"^```{language}\n(.*?)^```$", _readme(), flags=re.S | re.M)


def _python_blocks() -> list[str]:
  return _blocks("python")


def _clean_env() -> dict[str, str]:
  """This process's environment without the device flags that conftest and a
  user's shell may set: the README's code must set its own."""
  return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}


def test_the_first_two_bash_blocks_are_the_setup_and_test_commands():
  blocks = [b.strip() for b in _blocks("bash")]
  assert blocks[:2] == [SETUP, TESTS], blocks[:2]


def test_the_first_screen_is_install_example_measurements_limits_then_the_api():
  headings = re.findall(r"^## .*$", _readme(), flags=re.M)
  assert headings[:len(FIRST_SECTIONS)] == FIRST_SECTIONS, headings
  text = _readme()
  install = text[text.index("## Install"):text.index("## Example")]
  assert re.search(r"\d+ (to \d+ )?minutes on 2 cores", install), "the README says how long the test run takes"
  assert "-rs" in install, "the README says that skip reasons are shown"
  measured = text[text.index("## What was measured, where"):text.index("## Limits")]
  assert "| Date | Hardware | Commit |" in measured and "Not measured yet" in measured


def test_the_first_python_block_runs_alone_as_written_on_cpu(tmp_path):
  example = _python_blocks()[0]
  lines = example.splitlines()
  assert len(lines) <= 16, f"the short example has {len(lines)} lines"
  first_jax = next(i for i, line in enumerate(lines) if re.match(r"(import|from) jax", line))
  flags = [i for i, line in enumerate(lines) if "os.environ[" in line]
  assert flags and max(flags) < first_jax, "the example sets its device flags before importing jax"
  # Outside the source tree: `python -c` puts the working directory first on
  # the path, where the sources would shadow an installed wheel.
  proc = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, env=_clean_env(),
                        cwd=tmp_path, timeout=240)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert proc.stdout.splitlines() == ["[ 8. 10. 12. 14. 16. 18. 20. 22.]", "b12x"], proc.stdout


def test_readme_python_blocks_run_in_order_as_one_script(tmp_path):
  pytest.importorskip("flatbuffers", reason="the export block serializes: jax.export needs the flatbuffers package")
  blocks = _python_blocks()
  assert len(blocks) >= 3, "the README shows the short example, the API and jax.export"
  proc = subprocess.run([sys.executable, "-c", "\n".join(blocks)], capture_output=True, text=True,
                        env=_clean_env(), cwd=tmp_path, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "\n()\n" in proc.stdout, proc.stdout  # the export's ordered effects: none


def test_readme_export_block_disables_the_check_of_every_b12x_target():
  export_block = next(b for b in _python_blocks() if "jax.export" in b)
  named = set(re.findall(r'"(b12x_\w+)"', export_block))
  targets = {b12x_jax.ops.all_reduce.all_reduce_p.name, b12x_jax.ops.dcp_a2a.dcp_a2a_p.name,
             b12x_jax.ops.residual_rmsnorm.residual_rmsnorm_p.name}
  assert named == targets


def test_readme_names_flatbuffers_where_the_export_serializes():
  text = _readme()
  export = text[text.index("## jax.export"):]
  prose = export[:export.index("```python")]
  assert "flatbuffers" in prose, "the prose before the export block says that serialize() needs flatbuffers"
