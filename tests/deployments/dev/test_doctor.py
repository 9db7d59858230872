"""``offload-serve doctor``: simulated limits are flagged with their fixes and exit 1; this machine
passes on configs/local.yaml; ``make demo``'s preflight prints only problems; no torch or Ray."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.dev import cli, doctor
from deployments.dev.doctor_checks import Gpus, GpuSeen, Machine, Shm, Status, probe_gpus
from deployments.dev.doctor_config import read_config
from offload_core.host.ram import MemoryReading, host_ram_available

REPO = Path(__file__).resolve().parents[3]
LOCAL = REPO / "configs" / "local.yaml"
GiB, MiB = 2**30, 2**20
OBJECT_STORE = 200 * MiB  # what `make demo` and `offload-serve serve` start Ray with


def _ram(tmp_path: Path, total: int = 64 * GiB, available: int = 60 * GiB, cgroup_limit: int | None = None):
    """offload_core.host.ram's figure over a fake /proc and cgroup v2 tree (a limit when given)."""
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "self" / "cgroup").write_text("0::/pod\n")
    (cgroups / "pod").mkdir(parents=True, exist_ok=True)
    (cgroups / "cgroup.controllers").write_text("memory\n")
    (cgroups / "pod" / "memory.max").write_text("max\n" if cgroup_limit is None else f"{cgroup_limit}\n")
    (cgroups / "pod" / "memory.current").write_text(f"{GiB}\n")
    return host_ram_available(reserved_elsewhere=OBJECT_STORE, proc_root=proc, cgroup_root=cgroups,
                              memory_facts=lambda: MemoryReading(total, available))


def _machine(tmp_path: Path, *, memlock: int | None = None, shm_free: int = 32 * GiB, gpus: bool = True,
             cgroup_limit: int | None = None, env: dict | None = None) -> Machine:
    """A machine with one idle L4, a matching driver and CUDA torch, unless told otherwise."""
    seen = Gpus((GpuSeen(0, "NVIDIA L4", 24 * 10**9, 24 * 10**9 - 300 * MiB),), "550.54.15", (12, 4)) if gpus \
        else Gpus(error="NVML Shared Library Not Found")
    return Machine(memlock_bytes=memlock, shm=Shm(32 * GiB, shm_free), ram=_ram(tmp_path, cgroup_limit=cgroup_limit),
                   gpus=seen, torch_cuda=(12, 4) if gpus else None,
                   env={"RAY_AUTH_TOKEN": "t"} if env is None else env)


def _gpu_config(tmp_path: Path, budgets: dict | None = None, **denoiser) -> Path:
    """configs/gpu.yaml on the tiny zoo's model (no folder needed), the Denoiser's args as given, and
    ``budgets``: host_memory_budget by stage args key."""
    raw = yaml.safe_load((REPO / "configs" / "gpu.yaml").read_text())
    args = raw["applications"][0]["args"]
    args["model_path"] = None
    args["denoiser"] = {**args["denoiser"], **denoiser}
    for key, budget in (budgets or {}).items():
        args[key] = {**args[key], "host_memory_budget": budget}
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _rows(text: str) -> dict[str, str]:
    return {name: line for line in text.splitlines() for name in ("GPUs", "driver and CUDA", "locked memory",
                                                                   "/dev/shm", "host RAM", "Ray token", "model")
            if line.startswith(name + " ")}


def test_a_locked_memory_limit_below_the_pin_budget_fails_with_its_fix_and_exit_1(tmp_path, capsys):
    # The largest pin budget of a GPU replica: the Denoiser's 16 GiB host_memory_budget.
    config = _gpu_config(tmp_path, budgets={"encoder": "8GiB", "decoder": "2GiB"})
    assert doctor.main([str(config)], machine=_machine(tmp_path, memlock=64 * 1024)) == 1
    out = capsys.readouterr().out
    row = _rows(out)["locked memory"]
    assert "FAIL" in row and "ulimit -l 64 " in row and "16.00 GiB a Denoiser replica may pin" in row, out
    assert "ulimit -l unlimited" in out and "--ulimit memlock=-1" in out
    assert [name for name, line in _rows(out).items() if " FAIL " in line] == ["locked memory"], out
    # The same machine with the limit lifted passes: the exit was the limit's.
    assert doctor.main([str(config)], machine=_machine(tmp_path / "x", memlock=None)) == 0


def test_the_pin_budget_is_the_fleet_profiles_cap_without_a_host_budget(tmp_path, capsys):
    config = _gpu_config(tmp_path, host_memory_budget=None)  # no stage sets a host budget
    machine = _machine(tmp_path, memlock=8 * GiB)
    # The L4 profile may pin 0.5 of spendable RAM (60 GiB available - 3.2 GiB reserve - 200 MiB store).
    assert machine.ram.spendable // 2 > 8 * GiB
    assert doctor.main([str(config)], machine=machine) == 1
    assert f"{machine.ram.spendable // 2 / GiB:.2f} GiB a TextEncoder replica may pin" in capsys.readouterr().out


def test_a_dev_shm_smaller_than_the_object_store_fails_with_its_fix_and_exit_1(tmp_path, capsys):
    assert doctor.main([str(LOCAL)], machine=_machine(tmp_path, shm_free=64 * MiB)) == 1
    out = capsys.readouterr().out
    row = _rows(out)["/dev/shm"]
    assert "FAIL" in row and "64.00 MiB free" in row and "200.00 MiB object store" in row, out
    assert "--shm-size" in out
    # A smaller object store fits the same /dev/shm.
    assert doctor.main([str(LOCAL), "--object-store", "32MiB"], machine=_machine(tmp_path / "x", shm_free=64 * MiB)) == 0


def test_this_machine_passes_on_configs_local_yaml(capsys):
    assert doctor.main([str(LOCAL)]) == 0, capsys.readouterr().out


def test_a_cgroup_limit_below_a_replicas_host_budget_fails_naming_the_stage(tmp_path, capsys):
    config = _gpu_config(tmp_path)  # Denoiser: 16 GiB per replica
    assert doctor.main([str(config)], machine=_machine(tmp_path, cgroup_limit=12 * GiB)) == 1
    row = _rows(capsys.readouterr().out)["host RAM"]
    assert "FAIL" in row and "bound by cgroup v2" in row and "Denoiser asks for 16.00 GiB" in row, row


def test_a_gpu_config_on_a_machine_without_gpus_fails_on_the_gpus_and_torchs_cpu_build(tmp_path, capsys):
    config = _gpu_config(tmp_path)
    assert doctor.main([str(config)], machine=_machine(tmp_path, gpus=False)) == 1
    rows = _rows(capsys.readouterr().out)
    assert " FAIL " in rows["GPUs"] and "asks for 1" in rows["GPUs"]
    assert " FAIL " in rows["driver and CUDA"] and "CPU build" in rows["driver and CUDA"]


def test_a_driver_a_major_cuda_version_behind_torch_fails(tmp_path, capsys):
    machine = _machine(tmp_path)
    old = Machine(machine.memlock_bytes, machine.shm, machine.ram, Gpus(machine.gpus.seen, "470.1", (11, 4)),
                  (12, 4), machine.env)
    assert doctor.main([str(_gpu_config(tmp_path))], machine=old) == 1
    assert "major CUDA version behind" in _rows(capsys.readouterr().out)["driver and CUDA"]


def test_a_missing_ray_token_is_a_warning_with_its_fix_and_no_blocker(tmp_path, capsys):
    machine = _machine(tmp_path, env={"HOME": str(tmp_path)})
    assert doctor.main([str(LOCAL)], machine=machine) == 0
    out = capsys.readouterr().out
    assert " WARN " in _rows(out)["Ray token"] and "make demo or offload-serve serve creates it" in out


def test_a_model_folder_is_checked_present_and_of_a_known_family(tmp_path, capsys):
    from zoo.tiny import ensure_tiny_wan

    config = _gpu_config(tmp_path)
    for path, status in ((tmp_path / "nowhere", "FAIL"), (tmp_path, "FAIL"), (ensure_tiny_wan(), "OK")):
        raw = yaml.safe_load(config.read_text())
        raw["applications"][0]["args"]["model_path"] = str(path)
        config.write_text(yaml.safe_dump(raw))
        doctor.main([str(config)], machine=_machine(tmp_path / status / path.name))
        row = _rows(capsys.readouterr().out)["model"]
        assert f" {status} " in row, row
    assert "family wan" in row
    partial = tmp_path / "partial"
    shutil.copytree(ensure_tiny_wan(), partial)
    (partial / "transformer" / "diffusion_pytorch_model.safetensors").unlink()  # an interrupted download
    raw["applications"][0]["args"]["model_path"] = str(partial)
    config.write_text(yaml.safe_dump(raw))
    doctor.main([str(config)], machine=_machine(tmp_path / "partial-machine"))
    row = _rows(capsys.readouterr().out)["model"]
    assert " FAIL " in row and "transformer: no diffusion_pytorch_model.safetensors" in row, row


def test_demos_preflight_is_quiet_on_a_good_machine_and_prints_only_the_problems(tmp_path, capsys):
    good = _machine(tmp_path, env={"HOME": str(tmp_path)})  # no token: the demo creates it, so no problem
    assert doctor.preflight(LOCAL, OBJECT_STORE, machine=good) is True
    assert capsys.readouterr() == ("", "")
    assert doctor.preflight(LOCAL, OBJECT_STORE, machine=_machine(tmp_path / "x", shm_free=MiB)) is False
    err = capsys.readouterr().err
    assert "/dev/shm" in err and "FAIL" in err and "host RAM" not in err, err


def test_a_config_error_names_the_key_and_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        doctor.main([str(_gpu_config(tmp_path, host_memory_budget="16 gigs"))], machine=_machine(tmp_path))
    assert exit_.value.code == 2 and "denoiser.host_memory_budget" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        doctor.main([str(tmp_path / "missing.yaml")], machine=_machine(tmp_path))


def test_the_config_needs_count_fractional_gpus_as_whole_ones():
    needs = read_config(REPO / "configs" / "gpu.yaml", OBJECT_STORE)
    assert needs.gpus_needed() == 1  # 0.2 + 0.6 + 0.2
    assert read_config(LOCAL, OBJECT_STORE).gpus_needed() == 0


def test_gpus_free_memory_driver_and_cuda_come_from_nvml():
    class FakeNvml:
        class NVMLError(Exception):
            pass

        nvmlInit = nvmlShutdown = staticmethod(lambda: None)
        nvmlDeviceGetCount = staticmethod(lambda: 1)
        nvmlDeviceGetHandleByIndex = staticmethod(lambda i: i)
        nvmlDeviceGetName = staticmethod(lambda h: b"NVIDIA H200")
        nvmlDeviceGetMemoryInfo = staticmethod(lambda h: type("M", (), {"total": 140 * GiB, "free": 139 * GiB}))
        nvmlSystemGetDriverVersion = staticmethod(lambda: "570.86.15")
        nvmlSystemGetCudaDriverVersion = staticmethod(lambda: 12080)

    assert probe_gpus(FakeNvml) == Gpus((GpuSeen(0, "NVIDIA H200", 140 * GiB, 139 * GiB),), "570.86.15", (12, 8))


def test_doctor_has_help_and_imports_neither_torch_nor_ray():
    with pytest.raises(SystemExit) as exit_:
        cli.main(["doctor", "--help"])
    assert exit_.value.code == 0
    code = ("import sys; from deployments.dev import cli; rc = cli.main(['doctor']); "
            "print(rc, sorted(m for m in ('torch', 'ray', 'diffusers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.stdout.splitlines()[-1] == "0 []", done.stdout + done.stderr
    assert Status.FAIL.value not in done.stdout


def test_serve_runs_the_checks_first_and_starts_nothing_on_a_blocker(monkeypatch):
    from deployments.dev import cli, serve_local
    from deployments.dev import doctor as doctor_module

    started = []
    monkeypatch.setattr(doctor_module, "preflight", lambda config, object_store_bytes: False)
    monkeypatch.setattr(serve_local, "main", lambda config, port: started.append(config) or 0)
    assert cli.main(["serve", "configs/local.yaml"]) == 1 and started == []
    monkeypatch.setattr(doctor_module, "preflight", lambda config, object_store_bytes: True)
    assert cli.main(["serve", "configs/local.yaml"]) == 0 and len(started) == 1
