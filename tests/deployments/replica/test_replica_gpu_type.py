"""A stage replica's report and plan picture name the GPU type it planned for (mixed fleets: one
deployment's replicas differ by it)."""
from __future__ import annotations

from deployments.app import stage_configs
from deployments.models import families
from deployments.wire.spec import PipelineStage
from tests.deployments.conftest import tiny_args
from zoo.tiny import ensure_tiny_wan


def test_the_report_and_the_picture_carry_the_replicas_gpu_type(workers):
    facts = families.read_family_traits(ensure_tiny_wan())
    worker = workers(stage_configs(tiny_args(), facts)[PipelineStage.DENOISE])
    report = worker.report()
    assert report.gpu_type == "CPU"  # no GPU here; on one, its fleet profile's type ("L4", "H100")
    assert report.to_json()["gpu_type"] == "CPU"
    assert report.picture is not None and " on cpu (CPU): " in report.picture.title


def test_the_denoiser_reports_its_work_to_the_autoscaling_policy_as_floats():
    from deployments.capacity.work_autoscaling import REQUESTS, WORK_S
    from deployments.replica.stages import Denoiser

    facts = families.read_family_traits(ensure_tiny_wan())
    denoiser = Denoiser.func_or_class(stage_configs(tiny_args(), facts)[PipelineStage.DENOISE])
    try:
        stats = denoiser.record_autoscaling_stats()
        # Serve disables a replica's custom metrics for good on a first reply that is not all numbers.
        assert stats == {REQUESTS: 0.0, WORK_S: 0.0} and all(type(v) is float for v in stats.values())
        assert denoiser.record_routing_stats()["gpu|CPU"] == 1.0
    finally:
        denoiser.worker.close()
