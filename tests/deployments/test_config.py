"""The shipped Serve configs are valid Ray Serve configs whose args build the app's typed args."""
from __future__ import annotations

import pathlib

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import AppArgs
from deployments.capacity.gpu_shares import GpuNode, capacity_warning, shortfalls
from deployments.capacity.unplaced import demand_of

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
STAGES = {"TextEncoder", "Denoiser", "VaeDecoder", "Ingress"}


@pytest.mark.parametrize("name", ["local.yaml", "gpu.yaml", "tp.yaml"])
def test_a_serve_config_validates_and_names_every_deployment(name):
    schema = ServeDeploySchema.model_validate(yaml.safe_load((CONFIGS / name).read_text()))
    assert schema.http_options.host == "127.0.0.1", "the service must bind to localhost unless configured"
    (app,) = schema.applications
    assert app.import_path == "deployments.app:build_app"
    args = AppArgs.model_validate(app.args)
    assert args.app_name == app.name, "the residency board is named after the application"
    assert {d.name for d in app.deployments} == STAGES


def test_the_tp_config_gives_the_encoder_one_gpu_bundle_per_rank_strictly_packed():
    from deployments.app import tp_options

    (app,) = yaml.safe_load((CONFIGS / "tp.yaml").read_text())["applications"]
    args = AppArgs.model_validate(app["args"])
    [encoder] = [d for d in app["deployments"] if d["name"] == "TextEncoder"]
    options = tp_options("TextEncoder", encoder, args.encoder)
    assert options["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1}, {"CPU": 1.0, "GPU": 1}]
    assert options["placement_group_strategy"] == "STRICT_PACK" and options["ray_actor_options"]["num_gpus"] == 0


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


# The machine each config's header documents: local.yaml one machine without a GPU, gpu.yaml "One GPU
# node shared by the three stages".
DOCUMENTED_NODES = {"local.yaml": (GpuNode("documented-cpu-node", 0, 0.0),),
                    "gpu.yaml": (GpuNode("documented-gpu-node", 1, 1.0),)}


@pytest.mark.parametrize("name", sorted(DOCUMENTED_NODES))
def test_every_replica_a_config_allows_can_be_placed_on_the_machine_it_documents(name):
    (app,) = yaml.safe_load((CONFIGS / name).read_text())["applications"]
    demands = [demand_of(d["name"], d) for d in app["deployments"]]
    assert shortfalls(demands, DOCUMENTED_NODES[name]) == ()
    assert capacity_warning(demands, DOCUMENTED_NODES[name]) is None, "build_app would warn on it"
    assert AppArgs.model_validate(app["args"]).cluster_autoscaler is not True, "these machines do not autoscale"


def test_a_second_denoiser_at_0_6_of_the_one_gpu_is_what_the_check_refuses():
    (app,) = yaml.safe_load((CONFIGS / "gpu.yaml").read_text())["applications"]
    demands = [demand_of(d["name"], {**d, "num_replicas": 2} if d["name"] == "Denoiser" else d)
               for d in app["deployments"]]
    (short,) = shortfalls(demands, DOCUMENTED_NODES["gpu.yaml"])
    assert (short.deployment, short.wanted, short.placed) == ("Denoiser", 2, 1)
