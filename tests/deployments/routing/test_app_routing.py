"""build_app gives the Denoiser the predicted-finish router, and only the Denoiser; "default" turns it off."""
from deployments.app import AppArgs, build_app
from deployments.routing.config import ROUTER_CLASS


def _bound(args: AppArgs) -> dict:
    ingress = build_app(args)._bound_deployment  # Serve keeps the bound graph here, unbuilt
    stages = [stage._bound_deployment for stage in ingress.init_args[:3]]
    return {d.name: d._deployment_config.request_router_config for d in stages}


def test_the_denoiser_alone_routes_by_predicted_finish_with_the_configured_stats_period():
    configs = _bound(AppArgs(routing_stats_period_s=0.75))
    denoiser = configs.pop("Denoiser")
    assert denoiser.request_router_class == ROUTER_CLASS == "deployments.routing.router:PredictedFinishRouter"
    assert denoiser.request_routing_stats_period_s == 0.75
    assert denoiser.request_router_kwargs == {"stats_period_s": 0.75}  # the router's staleness: 2 periods
    assert all(c.request_router_class != ROUTER_CLASS for c in configs.values())


def test_routing_default_leaves_the_denoiser_on_serves_router():
    assert _bound(AppArgs(routing="default"))["Denoiser"].request_router_class != ROUTER_CLASS
