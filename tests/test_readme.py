"""The README's "Using the engine on your own model" example, run exactly as printed."""
from __future__ import annotations

import ast
import pathlib
import re
import tempfile

import torch

import offload_core
from offload_core import HostingTier

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Use the engine on your own model"


def readme_example() -> str:
    text = README.read_text()
    assert SECTION in text, f"README.md lost its {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def test_the_readme_example_imports_the_engine_only_from_the_public_api():
    tree = ast.parse(readme_example())
    project = ("offload_core", "cluster", "deployments", "zoo", "bench", "tests")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in project:
                assert module == "offload_core", f"README imports from {module}, not the public API"
                missing = [a.name for a in node.names if a.name not in offload_core.__all__]
                assert not missing, f"README uses names outside offload_core.__all__: {missing}"
        elif isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] in project for a in node.names), ast.unparse(node)


def test_the_readme_example_streams_a_diffusers_unet_bitwise_equal_to_the_plain_model(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its save_pretrained folder lands here
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(readme_example(), str(README), "exec"), namespace)

    assert (pathlib.Path(namespace["folder"]) / "diffusion_pytorch_model.safetensors").is_file()
    assert pathlib.Path(namespace["folder"]).parent == tmp_path
    assert torch.equal(namespace["streamed"], namespace["expected"])
    streamer, unet = namespace["streamer"], namespace["unet"]
    # Equality alone would also hold if nothing were streamed: the layers must have moved.
    assert [layer.key for layer in streamer.layers] == ["down_blocks.0", "down_blocks.1", "up_blocks.0", "up_blocks.1"]
    assert [layer.resident for layer in streamer.layers] == [True, False, False, False]
    mapped = streamer.layers[1]
    assert mapped.tier is HostingTier.MAPPED and mapped.host.nbytes == 0, "the mapped block was copied to RAM"
    assert streamer.bytes_copied >= sum(layer.nbytes for layer in streamer.layers)
    # The example ends with remove(): no hook left, every weight a plain tensor again.
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in unet.modules())
    with torch.no_grad():
        again = unet(namespace["sample"], namespace["timestep"], encoder_hidden_states=namespace["text"]).sample
    assert torch.equal(again, namespace["expected"])
