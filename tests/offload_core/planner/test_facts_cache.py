"""Real-size profiles kept on disk: planning again imports no model library and plans the same."""
from __future__ import annotations

import pytest

from offload_core.planner import facts_cache, real_models
from offload_core.planner.inputs import GiB, gpu_spec, real_model_facts
from offload_core.planner.search import plan_pipeline


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_SERVE_PLAN_CACHE", "1")
    monkeypatch.setenv("OFFLOAD_SERVE_CACHE", str(tmp_path))
    return tmp_path / "plan-facts"


def test_a_second_plan_reads_the_profiles_back_and_builds_nothing(cache, monkeypatch):
    gpu = gpu_spec("L4")
    first, notes = real_model_facts("wan2.1-t2v-1.3b", gpu, 64 * GiB)
    assert len(list(cache.glob("*.pickle"))) == 3  # text encoder, transformer, VAE

    def never(*_):
        raise AssertionError("a cached profile was built again")

    monkeypatch.setattr(real_models, "build_meta", never)
    again, notes_again = real_model_facts("wan2.1-t2v-1.3b", gpu, 64 * GiB)
    assert again.components == first.components and notes_again == notes
    assert plan_pipeline(again).explain() == plan_pipeline(first).explain()


def test_cached_profiles_equal_fresh_ones_and_an_unreadable_file_is_built_again(cache, monkeypatch):
    gpu = gpu_spec("L4")
    cached, _ = real_model_facts("wan2.1-t2v-1.3b", gpu, 64 * GiB)
    for path in cache.glob("*.pickle"):
        path.write_bytes(b"not a pickle")
    rebuilt, _ = real_model_facts("wan2.1-t2v-1.3b", gpu, 64 * GiB)
    monkeypatch.setenv("OFFLOAD_SERVE_PLAN_CACHE", "0")
    fresh, _ = real_model_facts("wan2.1-t2v-1.3b", gpu, 64 * GiB)
    assert cached.components == rebuilt.components == fresh.components


def test_the_key_changes_with_anything_the_profile_is_computed_from():
    import torch

    base = dict(name="transformer", class_name="WanTransformer3DModel", config={"num_layers": 30},
                dtype=torch.bfloat16, groups=("blocks",), uses=100, tables="t")
    key = facts_cache.profile_key(**base)
    assert key == facts_cache.profile_key(**base)
    for change in ({"config": {"num_layers": 40}}, {"dtype": torch.float32}, {"groups": None}, {"uses": 50},
                   {"tables": "u"}, {"class_name": "FluxTransformer2DModel"}):
        assert facts_cache.profile_key(**{**base, **change}) != key, change


def test_the_code_digest_covers_every_project_module_a_cached_build_runs(cache, monkeypatch):
    """A profile (and its notes) is cached under a digest of the code that computes it: a module the
    build runs but the digest leaves out would serve a stale profile after that module changed."""
    import sys
    from pathlib import Path

    root = Path(facts_cache.__file__).resolve().parents[1]  # offload_core/
    ran: set[str] = set()

    def record(frame, event, _arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(root):
                ran.add(path.relative_to(root).as_posix())

    built = []
    real_cached = facts_cache.cached_profile

    def traced(key, build):
        def run():
            sys.setprofile(record)
            try:
                return build()
            finally:
                sys.setprofile(None)
        built.append(key)
        return real_cached(key, run)

    monkeypatch.setattr(facts_cache, "cached_profile", traced)
    real_model_facts("flux.1-dev", gpu_spec("L4"), 64 * GiB)  # a VAE without layer groups: its note is cached too
    assert built and ran, "nothing was built under the trace"
    assert ran <= set(facts_cache._SOURCES), f"run by a cached build, not in the digest: {sorted(ran - set(facts_cache._SOURCES))}"


def test_the_code_digest_covers_the_skeletons_a_build_reads():
    from pathlib import Path

    from offload_core.planner import skeletons

    repo = Path(facts_cache.__file__).resolve().parents[2]
    assert skeletons.SKELETON_PATH.relative_to(repo).as_posix() in facts_cache._DATA
