"""No class name is defined twice in the project: two ``LayerOnHost`` or two ``DeviceBusy`` drift apart."""
from __future__ import annotations

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("offload_core", "cluster", "deployments", "zoo", "bench", "k8s")


def top_level_classes(root: pathlib.Path, packages=PACKAGES) -> dict[str, list[str]]:
    """Class name -> the modules that define it at top level."""
    where = collections.defaultdict(list)
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.parse(path.read_text(), str(path)).body:
                # Private classes (``_Entry``) cannot be imported as a project's fact; public ones can.
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    where[node.name].append(str(path.relative_to(root)))
    return where


def test_no_class_name_is_defined_twice_in_the_project():
    twice = {name: paths for name, paths in top_level_classes(ROOT).items() if len(paths) > 1}
    assert not twice, f"class names defined more than once: {twice}"


def test_the_walk_finds_a_class_defined_twice(tmp_path):
    # The walk itself must see duplicates, or the test above could never fail.
    for package in ("a", "b"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "m.py").write_text("class LayerOnHost:\n    pass\n\n\nclass _Private:\n    pass\n")
    found = top_level_classes(tmp_path, ("a", "b"))
    assert found["LayerOnHost"] == ["a/m.py", "b/m.py"] and "_Private" not in found
