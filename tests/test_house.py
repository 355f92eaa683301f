"""The house a new maintainer reads: the package's import graph has no
circle, every design citation in the code names a rule or a heading that
docs/DESIGN.md has, and every native constant the Python layer plans with
is the extension's."""

from __future__ import annotations

import ast
import glob
import importlib.util
import os
import re

import b12x_jax
from b12x_jax import _b12x, _native, policy
from b12x_jax.kernels import exchange
from b12x_jax.ops import _common
from b12x_jax.ops import all_reduce as all_reduce_module

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
PACKAGE = os.path.join(ROOT, "b12x_jax")
SOURCES = [p for pattern in ("b12x_jax/**/*.py", "ffi/**/*.h", "ffi/**/*.cc", "ffi/**/*.cu", "ffi/**/*.cuh",
                             "tests/*.py", "tests/gpu/*.py", "benchmarks/*.py", "examples/*.py", "scripts/*",
                             ".ci/run", "CMakeLists.txt", "pyproject.toml", "README.md")
           for p in glob.glob(os.path.join(ROOT, pattern), recursive=True) if not p.endswith("test_house.py")]


def _module_name(path: str) -> str:
  name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
  return name[:-len(".__init__")] if name.endswith(".__init__") else name


def _is_module(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None  # also the extension, which lives in no source file
  except ModuleNotFoundError:
    return False


def import_graph() -> dict[str, set[str]]:
  """Module -> the b12x_jax modules it imports anywhere (also inside a
  function: a call-time import is an edge too)."""
  paths = {_module_name(p): p for p in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)}
  graph = {}
  for name, path in paths.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    edges = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        edges |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module:  # `from p import m`: module m, else p itself
        edges |= {f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
                  for a in node.names}
    graph[name] = {e for e in edges if e in paths and e != name}
  return graph


def test_the_package_has_no_import_circle():
  graph = import_graph()
  state: dict[str, str] = {}

  def visit(name: str, path: list[str]) -> None:
    state[name] = "open"
    for dep in sorted(graph[name]):
      assert state.get(dep) != "open", f"import circle: {' -> '.join([*path, name, dep])}"
      if dep not in state:
        visit(dep, [*path, name])
    state[name] = "done"

  for name in sorted(graph):
    if name not in state:
      visit(name, [])
  assert "b12x_jax.ops.all_reduce" not in graph["b12x_jax.tuning"]  # calibration sits beside the op


def _design() -> str:
  with open(os.path.join(ROOT, "docs", "DESIGN.md"), encoding="utf-8") as f:
    return f.read()


def test_every_design_citation_names_a_rule_or_heading_of_the_design():
  design = _design()
  rules = set(re.findall(r"^- (C\d+) ", design, re.M))
  headings = set(re.findall(r"^#+ (.+)$", design, re.M))
  assert {f"C{i}" for i in range(1, 22)} <= rules
  bad = []
  for path in SOURCES:
    with open(path, encoding="utf-8") as f:
      text = f.read()
    where = os.path.relpath(path, ROOT)
    bad += [f"{where}: §" for _ in re.findall("§", text)]
    for first, last in re.findall(r"\bC(\d+)(?:-C(\d+))?\b(?=[),;: .])", text):
      for number in range(int(first), int(last or first) + 1):
        if f"C{number}" not in rules:
          bad.append(f"{where}: C{number}")
    for quoted in re.findall(r'DESIGN(?:\.md)?,? *"([^"]+)"', text):
      heading = " ".join(re.sub(r"#|//", " ", quoted).split())  # a citation broken over comment lines
      if heading not in headings:
        bad.append(f'{where}: "{heading}"')
  assert not bad, bad


def test_the_native_constants_python_plans_with_are_the_extensions():
  # ffi/channel.h kMaxRanks, kMaxBlocks, kPackBytes; ffi/all_reduce.h Algorithm.
  constants = _b12x.constants
  assert (_native.MAX_RANKS, _native.MAX_BLOCKS, _native.PACK_BYTES) == (8, 64, 16) == \
      (constants["max_ranks"], constants["max_blocks"], constants["pack_bytes"])
  assert policy.PACK_BYTES == _native.PACK_BYTES and _common.MAX_BLOCKS == _native.MAX_BLOCKS
  assert all_reduce_module._ALGORITHM_CODES == {k: v for k, v in _native.ALGORITHMS.items() if k != "lamport"}
  assert exchange.ALGORITHM_LAMPORT == _native.ALGORITHMS["lamport"]
  with open(os.path.join(ROOT, "ffi", "all_reduce.h"), encoding="utf-8") as f:
    enum = re.search(r"enum class Algorithm : uint32_t \{([^}]*)\}", f.read()).group(1)
  assert sorted(int(v) for v in re.findall(r"= (\d+)", enum)) == sorted(_native.ALGORITHMS.values())
  assert b12x_jax.Communicator(max_blocks=_native.MAX_BLOCKS).max_blocks == _native.MAX_BLOCKS


def test_the_readmes_layout_lists_every_module_after_the_ones_it_imports():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    layout = f.read().split("## Layout", 1)[1].split("```")[1]
  order = []
  for line in layout.strip().splitlines():
    first, *others = line.split("  ")[0].split(", ")
    folder = os.path.dirname(first)
    order += [first, *(f"{folder}/{name}" for name in others)]
  names = [_module_name(os.path.join(ROOT, path)) for path in order]
  graph = import_graph()
  assert sorted(names) == sorted(graph), sorted(set(graph) ^ set(names))
  for at, name in enumerate(names):
    later = set(graph[name]) & set(names[at:])
    assert not later, f"{name} imports {sorted(later)}, listed after it"
