"""The shipped Serve configs are valid Ray Serve configs whose args build the app's typed args."""
from __future__ import annotations

import pathlib

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import AppArgs

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
STAGES = {"TextEncoder", "Denoiser", "VaeDecoder", "Ingress"}


@pytest.mark.parametrize("name", ["local.yaml", "gpu.yaml"])
def test_a_serve_config_validates_and_names_every_deployment(name):
    schema = ServeDeploySchema.model_validate(yaml.safe_load((CONFIGS / name).read_text()))
    assert schema.http_options.host == "127.0.0.1", "the service must bind to localhost unless configured"
    (app,) = schema.applications
    assert app.import_path == "deployments.app:build_app"
    args = AppArgs.model_validate(app.args)
    assert args.app_name == app.name, "the residency board is named after the application"
    assert {d.name for d in app.deployments} == STAGES


def test_the_local_config_fits_on_two_cpus_without_a_gpu():
    (app,) = yaml.safe_load((CONFIGS / "local.yaml").read_text())["applications"]
    cpus = 0.0
    for deployment in app["deployments"]:
        options = deployment["ray_actor_options"]
        assert options.get("num_gpus", 0) == 0, deployment["name"]
        most = deployment.get("autoscaling_config", {}).get("max_replicas", deployment.get("num_replicas", 1))
        cpus += options["num_cpus"] * most
    assert cpus <= 2.0


@pytest.mark.parametrize("name", ["local.yaml", "gpu.yaml"])
def test_the_denoiser_holds_as_many_requests_as_a_batch_takes(name):
    (app,) = yaml.safe_load((CONFIGS / name).read_text())["applications"]
    denoiser = next(d for d in app["deployments"] if d["name"] == "Denoiser")
    max_batch = AppArgs.model_validate(app["args"]).batching.max_batch
    assert max_batch > 1, "step batching is the point of a Denoiser replica holding several requests"
    # The config file's option overrides build_app's: fewer would starve the batch, more would
    # queue requests in the replica instead of routing them to another one.
    assert denoiser["max_ongoing_requests"] == max_batch


def test_the_gpu_config_fits_the_one_gpu_node_it_documents():
    config = yaml.safe_load((CONFIGS / "gpu.yaml").read_text())
    most = 0.0
    for deployment in config["applications"][0]["deployments"]:
        replicas = deployment.get("autoscaling_config", {}).get("max_replicas", deployment.get("num_replicas", 1))
        most += deployment.get("ray_actor_options", {}).get("num_gpus", 0) * replicas
    assert most <= 1.0, f"at its maximum the config asks for {most} GPUs on a one-GPU node"
