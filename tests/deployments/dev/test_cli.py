"""``offload-serve``: one command with --help on each subcommand, clear errors, a readable residency report."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from deployments.dev import cli

REPORT = {"replicas": [{
    "replica": "SERVE_REPLICA::offload-serve#Denoiser#abc", "stage": "denoise", "device": "cpu", "mode": "memory",
    "plan": ["memory plan on cpu ...", "transformer: layerwise ..."], "predicted_peak_bytes": 3 * 2**20,
    "last_device_peak_bytes": 3 * 2**20, "last_bytes_streamed": 5 * 2**20,
    "weights": {"components": [{"name": "transformer", "layer_tiers": {"pinned": 2, "pageable": 0, "mapped": 1}}],
                "totals": {"device_bytes": 2**20, "host_pinned_bytes": 2 * 2**30, "host_staging_bytes": 2**20,
                           "host_pageable_bytes": 0, "host_mapped_bytes": 512, "host_shared_bytes": 0,
                           "parked_bytes": 0}},
    "leases": {"standing_bytes": 2**20, "reserved_bytes": 2 * 2**20}, "batch": {"size": 1, "mean": 1.5, "max": 4}}],
    "pending": [{"deployment": "VaeDecoder", "replica": "r2", "waiting_s": 12.3,
                 "reason": "wants 0.6 GPU on one GPU; no alive node has it free"}]}


@pytest.mark.parametrize("argv", [[], ["plan"], ["serve"], ["demo"], ["residency"]])
def test_every_subcommand_has_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: offload-serve" + (f" {argv[0]}" if argv else ""))


def test_the_console_script_is_installed_and_answers():
    script = shutil.which("offload-serve") or str(__import__("pathlib").Path(sys.executable).with_name("offload-serve"))
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "plan" in done.stdout and "residency" in done.stdout


def test_serve_without_a_config_file_and_an_unknown_command_exit_2(capsys, tmp_path):
    for argv, message in ((["serve", str(tmp_path / "nope.yaml")], "no config file"),
                          (["launch"], "invalid choice: 'launch'")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_residency_report_reads_as_one_block_per_replica_and_the_pending_ones():
    text = cli.render_residency(REPORT)
    assert "denoise SERVE_REPLICA::offload-serve#Denoiser#abc  on cpu, mode memory" in text
    assert "host pinned 2.00 GiB (staging 1.00 MiB), pageable 0 B, mapped 512 B" in text
    assert "leases standing 1.00 MiB, reserved 2.00 MiB; batch 1/4 (mean 1.5)" in text
    assert "transformer    layers: 2 pinned, 1 mapped" in text
    assert "pending  VaeDecoder r2: waiting 12 s: wants 0.6 GPU" in text


def test_residency_of_a_service_that_is_not_there_says_so_and_exits_1(capsys):
    from tests.conftest import free_port

    assert cli.main(["residency", f"http://127.0.0.1:{free_port()}"]) == 1
    assert "offload-serve residency: http://127.0.0.1:" in capsys.readouterr().err


def test_the_demo_finds_the_repositorys_config_by_default():
    from deployments.dev import demo

    assert (demo.REPO / "configs" / "local.yaml").is_file(), "make demo would fail before starting anything"
    # Checked before main() sets Ray's token environment: importing Ray then left make demo's driver
    # unauthenticated against its own head ("InvalidAuthToken"), so the check imports no Ray.
    probe = ("import sys; from deployments.dev import demo; "
             "assert demo.request_fault(demo.REPO / 'configs' / 'local.yaml', 'a lighthouse', '64x64', 4, 0) is None; "
             "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=demo.REPO)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr[-2000:]


@pytest.mark.parametrize("argv, message", [
    (["--size", "63x64"], "--size: width and height must be positive multiples of 16 for this model"),
    (["--size", "2048x2048"], "--size: 2048x2048 exceeds the configured maximum 512x512"),
    (["--steps", "0"], "--steps: Input should be greater than or equal to 1"),
    (["--prompt", " "], "--prompt: must not be empty"),
])
def test_a_demo_request_the_service_would_refuse_exits_2_before_ray_starts(argv, message, capsys, monkeypatch):
    from deployments.dev import demo, doctor, local_ray

    def started(*_args, **_kwargs):
        raise AssertionError("the demo went on to check the machine or start Ray")

    monkeypatch.setattr(doctor, "preflight", started)
    monkeypatch.setattr(local_ray, "start_head", started)
    with pytest.raises(SystemExit) as exit_:
        demo.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
