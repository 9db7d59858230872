"""The plan CLI: a readable table, one JSON object, local folders, and clear errors for bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload_core.planner.cli import main, parse_bytes

REPO = Path(__file__).resolve().parents[3]


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_wan_14b_on_an_l4_prints_a_table_row_per_component(capsys):
    code, out = run(capsys, "--model", "wan2.1-t2v-14b", "--gpu", "L4", "--host-ram", "64GiB")
    assert code == 0
    assert out.startswith("auto plan on L4 (24.00 GiB") and "feasible" in out
    rows = {line.split()[0] for line in out.splitlines() if line.split()}
    assert {"transformer", "text_encoder", "vae"} <= rows


def test_model_and_gpu_names_are_read_whatever_their_case(capsys):
    assert run(capsys, "--model", "FLUX.1-dev", "--gpu", "l4", "--host-ram", "64GiB", "--json")[1] == \
        run(capsys, "--model", "flux.1-dev", "--gpu", "L4", "--host-ram", "64GiB", "--json")[1]


def test_json_is_one_object_with_the_plan_and_its_predictions(capsys):
    code, out = run(capsys, "--model", "flux.1-dev", "--gpu", "H100", "--host-ram", "128GiB", "--mode", "memory",
                    "--json")
    plan = json.loads(out)
    assert code == 0 and plan["mode"] == "memory" and plan["feasible"] is True
    assert {c["name"] for c in plan["components"]} == {"transformer", "text_encoder", "text_encoder_2", "vae"}
    assert plan["peak_device_bytes"] <= plan["weight_budget"]
    assert all(c["prediction"]["in_use_bytes"] > 0 for c in plan["components"])


def test_a_local_diffusers_folder_is_planned_from_its_own_configs(capsys):
    from zoo.tiny import ensure_tiny_wan

    code, out = run(capsys, "--model-dir", str(ensure_tiny_wan()), "--gpu", "RTX3060", "--host-ram", "16GiB",
                    "--json")
    plan = json.loads(out)
    assert code == 0 and plan["mode"] == "auto"
    # The tiny folder fits a 12 GB card many times over: every component resident, planned with
    # exactly the bytes of its own checkpoint (a registry model of the same family would be GBs).
    in_use = {c["name"]: (c["strategy"], c["prediction"]["in_use_bytes"]) for c in plan["components"]}
    assert in_use == {name: ("resident", _checkpoint_bytes(ensure_tiny_wan() / name))
                      for name in ("text_encoder", "transformer", "vae")}


def _checkpoint_bytes(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys())
    return total


def test_tp_2_plans_the_umt5_xxl_encoder_as_one_rank_holds_it(capsys):
    args = ("--model", "wan2.1-t2v-14b", "--gpu", "L4", "--host-ram", "64GiB", "--json")
    whole = json.loads(run(capsys, *args)[1])
    code, out = run(capsys, *args, "--tp", "2")
    plan = json.loads(out)
    assert code == 0 and plan["feasible"] is True
    # Only the stage with a tensor-parallel plan; its vocab-parallel table is kept, never hosted.
    [encoder] = plan["components"]
    assert encoder["name"] == "text_encoder" and encoder["host_tables"] is False
    table = 256384 * 4096 * 4
    rank = encoder["prediction"]["in_use_bytes"]
    [unsharded] = [c for c in whole["components"] if c["name"] == "text_encoder"]
    assert 0.49 < rank / (5_680_000_000 * 4) < 0.51, rank  # umT5-XXL encoder: ~5.68 B fp32 parameters
    assert rank < unsharded["prediction"]["in_use_bytes"] + table // 2
    assert any("tensor-parallel over 2 ranks; rank 0 holds 10.58 of 21.16 GiB" in n for n in plan["notes"])


def test_tp_2_plans_the_flux_dit_with_diffusers_plan_as_one_rank_holds_it(capsys):
    code, out = run(capsys, "--model", "flux.1-dev", "--gpu", "L4", "--host-ram", "64GiB", "--json", "--tp", "2")
    plan = json.loads(out)
    # The denoiser only: the encode stage's CLIP has no plan. Attention and FFN are split, the adaLN
    # modulation and norms are whole on every rank: 0.638 of the 22.17 GiB.
    assert code == 0 and [c["name"] for c in plan["components"]] == ["transformer"]
    assert any("transformer: tensor-parallel over 2 ranks; rank 0 holds 14.15 of 22.17 GiB (0.638)" in n
               for n in plan["notes"]), plan["notes"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "z-image-turbo", "--gpu", "L4", "--host-ram", "64GiB", "--tp", "2"],
     "no stage of ZImagePipeline has a tensor-parallel plan for --tp 2; classes with plans: "
     "['FluxTransformer2DModel', 'QwenImageTransformer2DModel', 'T5EncoderModel', 'UMT5EncoderModel']"),
    (["--model", "wan2.1-t2v-14b", "--gpu", "L4", "--host-ram", "64GiB", "--tp", "0"], "--tp must be >= 1"),
    (["--model", "wan2.1-t2v-14b", "--gpu", "L4", "--host-ram", "64GiB", "--tp", "3"],
     "tp_size 3: text_encoder (UMT5EncoderModel) has 64 attention heads, which do not divide over 3 ranks; "
     "a tp_size that divides 64: 2, 4, 8, 16, ..."),
    (["--model", "flux.1-dev", "--gpu", "L4", "--host-ram", "64GiB", "--tp", "5"],
     "transformer (FluxTransformer2DModel) has 24 attention heads, which do not divide over 5 ranks"),
    (["--model", "wan2.2-t2v-a14b", "--gpu", "L4", "--host-ram", "64GiB", "--shift", "0"], "--shift must be > 0, got 0"),
    (["--model", "qwen-image", "--gpu", "L4", "--host-ram", "64GiB", "--steps", "1"],
     "--steps 1: qwen-image needs at least 2 (its scheduler's shift_terminal makes a shorter schedule NaN"),
    (["--model", "wan2.2-t2v-a14b", "--gpu", "L4", "--host-ram", "64GiB", "--shift", "-1"], "--shift must be > 0"),
    (["--model", "wan2.1-t2v-14b", "--gpu", "TPU", "--host-ram", "64GiB"], "unknown GPU 'TPU'"),
    (["--model", "sd-9", "--gpu", "L4", "--host-ram", "64GiB"], "unknown model 'sd-9'"),
    (["--model", "flux.1-dev", "--gpu", "4090", "--host-ram", "64GiB"], "unknown GPU '4090'; did you mean RTX4090?"),
    (["--model", "wan2.1-14b", "--gpu", "L4", "--host-ram", "64GiB"], "unknown model 'wan2.1-14b'; did you mean wan2.1-t2v-14b?"),
    (["--model", "flux.1-dev", "--gpu", "V100", "--host-ram", "64GiB"], "unknown GPU 'V100'; known:"),  # no H100 hint
    (["--model", "wan2.1-t2v-14b", "--gpu", "L4", "--host-ram", "lots"], "not a byte size: 'lots'"),
    (["--model-dir", "/nonexistent", "--gpu", "L4", "--host-ram", "64GiB"], "has no model_index.json"),
    (["--model", "flux.1-dev", "--gpu", "L4", "--host-ram", "64GiB", "--working-set", "100GiB"],
     "--working-set 100.00 GiB leaves no room for weights on the L4's 24.00 GiB"),
    (["--model", "flux.1-dev", "--gpu", "L4", "--host-ram", "0GiB"], "--host-ram must be > 0, got 0 B"),
    (["--model", "wan2.1-t2v-14b", "--gpu", "L4", "--host-ram", "64GiB", "--picture", "plan.jpg"],
     "must end in .svg or .png"),
])
def test_bad_arguments_exit_2_naming_what_was_wrong(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_picture_of_the_plan_is_written_beside_the_table(capsys, tmp_path):
    from zoo.tiny import ensure_tiny_wan

    code, out = run(capsys, "--model-dir", str(ensure_tiny_wan()), "--gpu", "RTX3060", "--host-ram", "16GiB",
                    "--mode", "memory", "--picture", str(tmp_path / "plan.svg"))
    svg = (tmp_path / "plan.svg").read_bytes()
    assert code == 0 and out.startswith("memory plan on RTX3060")
    assert svg.startswith(b"<?xml") and all(f"{name}, predicted".encode() in svg
                                            for name in ("text_encoder", "transformer", "vae"))


def test_byte_sizes_take_binary_and_decimal_units():
    assert parse_bytes("64GiB") == 64 * 2**30 and parse_bytes("512MB") == 512 * 10**6 and parse_bytes("7") == 7


def test_runs_as_the_offload_serve_plan_command():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "deployments.dev.cli", "plan", "--model", "wan2.1-t2v-1.3b", "--gpu", "RTX3060",
                           "--host-ram", "32GiB", "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["device_name"] == "RTX3060"


def test_offload_serve_plan_tiles_the_vae_where_the_service_does_unless_told(capsys):
    from deployments.dev.cli import main as offload_serve

    def working_set(*extra):
        assert offload_serve(["plan", "--model", "hunyuanvideo-1.5-480p-t2v", "--gpu", "H200", "--host-ram", "64GiB",
                              "--json", *extra]) == 0
        return next(n for n in json.loads(capsys.readouterr().out)["notes"] if n.startswith("working set"))

    assert "VAE tiled" in working_set(), "HunyuanVideo 1.5 tiles by default (vae_tiling: auto)"
    assert "VAE tiled" not in working_set("--vae-tiling", "off")
    code, out = run(capsys, "--model", "wan2.1-t2v-1.3b", "--gpu", "L4", "--host-ram", "64GiB", "--json")
    assert not any("VAE tiled" in n for n in json.loads(out)["notes"]), "offload_core's own default: untiled"
