"""The image the manifests run: its Dockerfile installs what the Makefile installs, as non-root, on
Ray's own image of the manifests' Ray version; every manifest names it and turns Ray's token on.
(No image can be built on these machines; the recipe is checked as text.)"""
from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "k8s").glob("rayservice*.yaml"))


def _logical_lines(text: str) -> list[str]:
    return [line.strip() for line in text.replace("\\\n", " ").splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _pip_installs(commands: list[str]) -> list[list[str]]:
    """Each `pip install` as its arguments, with the interpreter and variables' spelling unified."""
    installs = []
    for command in commands:
        for part in command.split("&&"):
            words = shlex.split(re.sub(r"\$[({]TORCH_SPEC[)}]", "TORCH_SPEC", part))
            if "pip" in words and "install" in words:
                args = [w for w in words[words.index("install") + 1:] if w not in ("-q", "-e")]
                installs.append([re.sub(r"\[.*\]$", "", a) for a in args])  # extras: test deps stay out
    return installs


def _makefile_install_recipe() -> list[str]:
    lines = (REPO / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("$(STAMP):"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def _dockerfile() -> list[str]:
    return _logical_lines((REPO / "Dockerfile").read_text())


def _built_tag() -> str:
    match = re.search(r"docker build -t (\S+) \.", (REPO / "Dockerfile").read_text())
    assert match, "the Dockerfile's header must say how it is built and tagged"
    return match.group(1)


def test_the_dockerfile_installs_exactly_what_the_makefile_installs_in_the_same_order():
    runs = [line[len("RUN "):] for line in _dockerfile() if line.startswith("RUN ")]
    docker, make = _pip_installs(runs), _pip_installs(_makefile_install_recipe())
    assert make == [["--upgrade", "pip"], ["TORCH_SPEC"], ["-c", "constraints.txt", "."]], make
    assert docker == make


def _render_module():
    spec = importlib.util.spec_from_file_location("k8s_render_image", REPO / "k8s" / "render.py")
    render = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = render  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(render)
    return render


def test_the_image_builds_on_rays_own_gpu_image_of_the_manifests_ray_version():
    RAY_VERSION = _render_module().RAY_VERSION
    (base,) = [line.split()[1] for line in _dockerfile() if line.startswith("FROM ")]
    assert base == f"rayproject/ray:{RAY_VERSION}-py311-gpu"
    assert _built_tag().endswith(f"ray{RAY_VERSION}-py311-gpu")


def test_the_image_installs_and_runs_as_a_non_root_user():
    users = [line.split()[1] for line in _dockerfile() if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), users
    lines = _dockerfile()
    last_user = max(i for i, line in enumerate(lines) if line.startswith("USER "))
    installs = [i for i, line in enumerate(lines) if line.startswith("RUN ") and "pip install" in line]
    assert installs and min(installs) > last_user, "pip runs as root"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_runs_that_image_with_rays_token_auth_from_a_secret(path):
    manifest = yaml.safe_load(path.read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    assert images == {_built_tag()}
    auth = cluster["authOptions"]
    assert auth["mode"] == "token" and auth["secretName"], auth
    assert "RAY_AUTH_MODE" not in path.read_text(), "the manifest must not switch Ray's token off"


def test_nothing_users_run_turns_rays_token_off():
    for path in ["Makefile", "Dockerfile", "deployments/dev/demo.py", "deployments/dev/local_ray.py",
                 *map(str, (REPO / "configs").glob("*.yaml"))]:
        assert "RAY_AUTH_MODE=disabled" not in (REPO / path).read_text().replace(" ", ""), path
        assert "disabled" not in re.findall(r"RAY_AUTH_MODE\W+(\w+)", (REPO / path).read_text()), path
