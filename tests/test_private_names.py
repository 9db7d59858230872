"""Private names of torch, diffusers, transformers, Ray, Starlette and FastAPI appear only under compat/.

An approximation, by AST (no import, well under a second): in every module the project ships or runs
(benches and the simulator included), a finding is
- an import of an underscore module of one of those libraries (``ray._private.state``), or of an
  underscore name from one (``from starlette._utils import x``, ``from x import _y``);
- an underscore attribute reached from a name bound to one of them (``torch._dynamo``, ``nn.Module._x``);
- an underscore attribute, ``getattr`` string or keyword argument the project never defines itself
  (``pipe._execution_device``, ``getattr(cls, "_tp_plan")``, ``deploy_apps(c, _blocking=False)``):
  the project's own privates (``self._x``, its classes' and modules' ``_names``) are not findings;
- a string naming Ray's internal resources (``"node:__internal_head__"``).
It misses a library's private attribute read through ``self`` or one whose name the project also
defines; the import contracts and this scan together catch the rest at review.
"""
from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCANNED = ("offload_core", "cluster", "deployments", "zoo", "bench", "k8s", "testing")
LIBRARIES = frozenset({"torch", "diffusers", "transformers", "ray", "starlette", "fastapi"})
PRIVATE_STRINGS = ("__internal_head__",)  # Ray's resource marking the head node
NAME_CALLS = frozenset({"getattr", "hasattr", "setattr", "delattr"})


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def library_of(module: str | None) -> str | None:
    root = (module or "").split(".")[0]
    return root if root in LIBRARIES else None


class ModuleScan:
    """One pass over a module's tree: the underscore names it defines, the names it binds to the
    libraries, and the candidate findings (judged once every module's definitions are known)."""

    def __init__(self, source: str, path: str):
        self.path, self.defined, self.bound = path, set(), set()
        self.sure: list[Finding] = []  # private whatever the project defines
        self.unless_defined: list[tuple[str, Finding]] = []  # private unless the project defines the name
        self.attributes: list[tuple[str | None, str, int]] = []  # (root name, underscore attribute, line)
        for node in ast.walk(ast.parse(source, filename=path)):
            self._visit(node)

    def findings(self, project: set[str]) -> list[Finding]:
        found = list(self.sure)
        for root, attr, line in self.attributes:
            if root in self.bound:
                found.append(Finding(self.path, line, f"{root}...{attr}: an underscore attribute of a library name"))
            elif attr not in project:
                found.append(Finding(self.path, line, f".{attr}: an underscore attribute the project does not define"))
        return found + [f for name, f in self.unless_defined if name not in project]

    def _visit(self, node: ast.AST) -> None:
        kind = type(node)
        if kind is ast.Attribute:
            self._attribute(node)
        elif kind is ast.Name:
            if type(node.ctx) is ast.Store:
                self._define(node.id)
        elif kind is ast.Call:
            self._call(node)
        elif kind is ast.Constant:
            if type(node.value) is str:
                for marker in PRIVATE_STRINGS:
                    if marker in node.value:
                        self._sure(node, f"the string {marker!r}: a library's internal name")
        elif kind in (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda):
            if kind is not ast.Lambda:
                self._define(node.name)
            if kind is not ast.ClassDef:
                args = node.args
                for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
                    if a is not None:
                        self._define(a.arg)
        elif kind is ast.Import or kind is ast.ImportFrom:
            self._import(node)

    def _define(self, name: str) -> None:
        if name[0] == "_":
            self.defined.add(name)

    def _sure(self, node: ast.AST, what: str) -> None:
        self.sure.append(Finding(self.path, node.lineno, what))

    def _unless_defined(self, name: str, node: ast.AST, what: str) -> None:
        self.unless_defined.append((name, Finding(self.path, node.lineno, what)))

    def _attribute(self, node: ast.Attribute) -> None:
        root = _root_name(node.value)
        if root in ("self", "cls"):
            if type(node.ctx) is ast.Store:
                self._define(node.attr)
            return
        if not is_private(node.attr):
            return
        self.attributes.append((root, node.attr, node.lineno))  # judged once the whole module's imports are known

    def _call(self, node: ast.Call) -> None:
        func = node.func.id if type(node.func) is ast.Name else None
        if func in NAME_CALLS and len(node.args) > 1:
            name = node.args[1]
            if type(name) is ast.Constant and type(name.value) is str and is_private(name.value):
                self._unless_defined(name.value, node, f"{func}(..., {name.value!r}): an underscore attribute "
                                                       "the project does not define")
        for kw in node.keywords:
            if kw.arg and is_private(kw.arg):
                self._unless_defined(kw.arg, node, f"{kw.arg}=: an underscore keyword the project does not define")

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        for alias in node.names:
            self._define(alias.asname or alias.name.split(".")[0])
        if type(node) is ast.Import:
            for a in node.names:
                if library_of(a.name):
                    self.bound.add(a.asname or a.name.split(".")[0])
                    if any(is_private(p) for p in a.name.split(".")):
                        self._sure(node, f"imports {a.name}, an underscore module")
        elif node.level == 0 and library_of(node.module):
            self.bound.update(a.asname or a.name for a in node.names)
            if any(is_private(p) for p in node.module.split(".")):
                self._sure(node, f"imports from {node.module}, an underscore module")
            else:
                for a in node.names:
                    if is_private(a.name):
                        self._sure(node, f"imports {node.module}.{a.name}, an underscore name")


def _root_name(node: ast.AST) -> str | None:
    while type(node) is ast.Attribute:
        node = node.value
    return node.id if type(node) is ast.Name else None


def project_modules() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for top in SCANNED for p in sorted((ROOT / top).rglob("*.py"))}


def scan(modules: dict[str, str]) -> list[Finding]:
    """Findings in ``modules`` (path -> source); names any of them defines count as the project's."""
    scans = [ModuleScan(source, path) for path, source in modules.items()]
    project = set().union(*(s.defined for s in scans))
    return [f for s in scans for f in s.findings(project)]


def test_private_names_of_libraries_only_under_compat():
    # ~0.9-1.6 s of CPU over 260 modules on the CI-class VM (2026-12-07): its cost is the suite's, watched with
    # the suite's time (docs/benchmarks.md), never asserted here: it took 1.58 s
    # beside a suite run against the 2 s bound it had, so a busier hour would fail it on no change of code.
    found = scan(project_modules())
    assert not found, ("private API of a library outside compat/ (wrap it in compat/<library>.py, "
                       "with a test in tests/compat/):\n" + "\n".join(map(str, found)))


# Each rule, on a module that breaks it: the scan above passes only because these are absent.
@pytest.mark.parametrize("source, expected", [
    ("from ray._private.state import actors\n", "ray._private.state, an underscore module"),
    ("import torch.utils._pytree as pytree\n", "torch.utils._pytree, an underscore module"),
    ("from starlette._utils import get_route_path\n", "starlette._utils, an underscore module"),
    ("from diffusers.hooks.tensor_parallel import _styles\n", "tensor_parallel._styles, an underscore name"),
    ("import torch\nx = torch._dynamo\n", "torch..._dynamo"),
    ("from torch import nn\ndef f(m):\n    return nn.Module._apply\n", "nn..._apply"),
    ("def f(pipe):\n    return pipe._execution_device\n", "._execution_device: an underscore attribute"),
    ("def f(m):\n    return m._parameters['w']\n", "._parameters: an underscore attribute"),
    ("def f(cls):\n    return getattr(cls, '_tp_plan', None)\n", "'_tp_plan'"),
    ("def f(client, c):\n    client.deploy_apps(c, _blocking=False)\n", "_blocking=: an underscore keyword"),
    ("R = {'node:__internal_head__': 0.001}\n", "'__internal_head__'"),
])
def test_each_kind_of_private_use_is_found(source, expected):
    found = scan({"deployments/example.py": source})
    assert len(found) == 1 and expected in found[0].what, found


@pytest.mark.parametrize("source", [
    "class A:\n    def __init__(self):\n        self._n = 0\n\ndef f(a):\n    return a._n\n",  # the project's own
    "import torch\nx = torch.nn.Module.__init__\n",  # a dunder is a protocol, not a private name
    "from . import _local\n",  # the project's own underscore module
    "def f(t):\n    return t.to_local()\n",
])
def test_the_projects_own_privates_are_not_findings(source):
    assert scan({"offload_core/example.py": source}) == []
