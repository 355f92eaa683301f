"""The README's API reference documents every public name of b12x_jax (its
``__all__``), and each documented signature is the real one.

An entry is a list item that starts with a code span: ``- `all_reduce(x,
axis_name, *, ...)`: what it does``. The span is the name and, for a
callable, its parameters as Python writes them (defaults as expressions:
``8 << 20``); for an exception class, its bases; for a constant, the name
alone. Members of Communicator are entries named ``Communicator.member``.
"""

from __future__ import annotations

import ast
import inspect
import os
import re

import pytest

import b12x_jax

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
HEADING = "## API reference"
_EMPTY = object()  # a parameter without a default


def _api_section() -> str:
  with open(README, encoding="utf-8") as f:
    text = f.read()
  start = text.find(f"\n{HEADING}\n")
  assert start >= 0, f"README.md has no '{HEADING}' section"
  body = text[start + len(HEADING) + 2:]
  end = re.search(r"^## ", body, flags=re.M)
  return body if end is None else body[:end.start()]


_ENTRY = re.compile(r"^[ \t]*- `([^`]+)`", flags=re.M)


def _entry_texts() -> list[tuple[str, str, str]]:
  """(name, the span after the name, the entry's whole text) of each entry:
  its text runs to the next entry or heading (a table after it included)."""
  section = _api_section()
  starts = [m.start() for m in _ENTRY.finditer(section)] + [len(section)]
  found = []
  for begin, end in zip(starts, starts[1:]):
    text = section[begin:end]
    heading = re.search(r"^#", text, flags=re.M)
    text = text if heading is None else text[:heading.start()]
    span = " ".join(_ENTRY.match(text).group(1).split())  # a span may wrap over lines
    named = re.match(r"((?:Communicator\.)?[A-Za-z_]\w*)(.*)$", span)
    assert named, f"README API entry `{span}` does not start with a name"
    found.append((named.group(1), named.group(2).strip(), text))
  return found


def _entries() -> dict[str, list[str]]:
  """Documented name -> the text after the name in each of its entries'
  code spans ("(x, axis_name, *, channel=None)", "" for a constant)."""
  entries: dict[str, list[str]] = {}
  for name, rest, _ in _entry_texts():
    entries.setdefault(name, []).append(rest)
  return entries


def _kinds(obj) -> str:
  if isinstance(obj, type) and issubclass(obj, BaseException):
    return "exception"
  return "callable" if callable(obj) else "constant"


def _documented_parameters(rest: str, where: str) -> list[tuple[str, inspect._ParameterKind, object]]:
  """(name, kind, default) of each parameter of the signature text ``rest``
  ("(a, b=1, *, c=None) -> T"), defaults evaluated."""
  try:
    tree = ast.parse(f"def _{rest}: pass")
  except SyntaxError as e:
    raise AssertionError(f"README API entry `{where}{rest}` is not a Python signature: {e}") from None
  args = tree.body[0].args

  def default(node):
    if node is None:
      return _EMPTY
    return eval(compile(ast.Expression(node), f"README `{where}`", "eval"), {"__builtins__": {}})  # noqa: S307

  kind = inspect.Parameter
  positional = [(a, kind.POSITIONAL_ONLY) for a in args.posonlyargs] + [(a, kind.POSITIONAL_OR_KEYWORD)
                                                                        for a in args.args]
  defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
  params = [(a.arg, k, default(d)) for (a, k), d in zip(positional, defaults)]
  if args.vararg is not None:
    params.append((args.vararg.arg, kind.VAR_POSITIONAL, _EMPTY))
  params += [(a.arg, kind.KEYWORD_ONLY, default(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
  if args.kwarg is not None:
    params.append((args.kwarg.arg, kind.VAR_KEYWORD, _EMPTY))
  return params


def _real_parameters(obj, drop_self: bool = False) -> list[tuple[str, inspect._ParameterKind, object]]:
  params = list(inspect.signature(obj).parameters.values())
  if drop_self:
    params = params[1:]
  return [(p.name, p.kind, _EMPTY if p.default is inspect.Parameter.empty else p.default) for p in params]


def _public():
  return [(name, getattr(b12x_jax, name)) for name in b12x_jax.__all__]


@pytest.mark.parametrize("name", b12x_jax.__all__)
def test_every_public_name_has_an_entry_in_the_api_reference(name):
  entries = _entries()
  kind = _kinds(getattr(b12x_jax, name))
  want = {"callable": f"`{name}(...)`", "exception": f"`{name}(Base, ...)`", "constant": f"`{name}`"}[kind]
  assert name in entries, (f"b12x_jax.{name} is public (b12x_jax.__all__) but README.md's '{HEADING}' "
                           f"has no entry for it: add a list item starting with {want} and what it does")
  for rest in entries[name]:
    if kind == "constant":
      assert rest == "", f"README API entry `{name}{rest}`: {name} is a constant, write `{name}` alone"
    else:
      assert rest.startswith("("), f"README API entry `{name}{rest}`: write {want}"


def test_every_entry_names_a_public_object():
  public = set(b12x_jax.__all__)
  members = set(dir(b12x_jax.Communicator)) | set(vars(b12x_jax.Communicator()))
  for name in _entries():
    if name.startswith("Communicator."):
      member = name.split(".", 1)[1]
      assert member in members and not member.startswith("_"), f"README documents {name}, which does not exist"
    else:
      assert name in public, f"README documents `{name}`, which is not in b12x_jax.__all__"


@pytest.mark.parametrize("name", [name for name, obj in _public() if _kinds(obj) == "callable"])
def test_documented_signatures_are_the_real_ones(name):
  obj = getattr(b12x_jax, name)
  real = _real_parameters(obj)
  for rest in _entries().get(name, []):
    documented = _documented_parameters(rest, name)
    assert [p[0] for p in documented] == [p[0] for p in real], (
        f"README documents {name}{rest}; its parameters are {inspect.signature(obj)}")
    assert documented == real, f"README documents {name}{rest}; the signature is {name}{inspect.signature(obj)}"


def test_documented_communicator_members_are_the_real_ones():
  documented = {name: rests for name, rests in _entries().items() if name.startswith("Communicator.")}
  assert documented, "README documents no Communicator method (Communicator.prepare(...), ...)"
  instance = b12x_jax.Communicator()
  for name, rests in documented.items():
    member = name.split(".", 1)[1]
    attr = inspect.getattr_static(b12x_jax.Communicator, member, None)
    for rest in rests:
      if attr is None or isinstance(attr, property):  # an attribute or property: no parameters
        assert rest == "", f"README documents {name}{rest}, which is an attribute"
        assert member in vars(instance) or attr is not None
        continue
      real = _real_parameters(getattr(b12x_jax.Communicator, member), drop_self=True)
      assert _documented_parameters(rest, name) == real, (
          f"README documents {name}{rest}; the signature is "
          f"{inspect.signature(getattr(instance, member))}")


def test_every_documented_parameter_is_described_in_its_entry():
  for name, rest, text in _entry_texts():
    if not rest.startswith("(") or name in b12x_jax.__all__ and _kinds(getattr(b12x_jax, name)) == "exception":
      continue
    description = text[_ENTRY.match(text).end():]  # after the signature
    for param, _, _ in _documented_parameters(rest, name):
      assert f"`{param}" in description, (
          f"README's entry for {name} does not say what `{param}` is: name it in backticks in the entry")


@pytest.mark.parametrize("name", [name for name, obj in _public() if _kinds(obj) == "exception"])
def test_documented_exception_bases_are_the_real_ones(name):
  cls = getattr(b12x_jax, name)
  for rest in _entries()[name]:
    bases = ast.parse(f"class _{rest}: pass").body[0].bases
    assert [ast.unparse(b) for b in bases] == [b.__name__ for b in cls.__bases__], (
        f"README documents {name}{rest}; its bases are {[b.__name__ for b in cls.__bases__]}")


def test_documented_constants_give_their_value():
  section = _api_section()
  for name, obj in _public():
    if _kinds(obj) == "constant" and name != "__version__":
      entry = re.search(rf"^[ \t]*- `{re.escape(name)}`(.*)$", section, flags=re.M)
      assert entry and repr(obj).replace("'", '"') in entry.group(1), (
          f"README's entry for {name} must give its value {obj!r}")
