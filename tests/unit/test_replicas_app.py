"""The Serve application `codespec serve --replicas` and `serve run codespec.replicas:app_builder` deploy: its
options come from `codespec serve`'s (built offline: nothing starts Ray here)."""

import pytest

from codespec.cli.options import build_parser
from codespec.errors import CodespecError
from codespec.replicas import app_builder, build_app


def test_app_builder_takes_codespec_serve_options(tiny_dir):
    app = app_builder({"replicas": "3", "model": str(tiny_dir), "parallel": "4", "max-queue": "8",
                       "replica_cpus": "0.5", "api_key": "k1,k2"})
    gateway = app._bound_deployment
    engine = gateway.init_args[0]._bound_deployment
    assert (gateway.name, engine.name) == ("CodespecGateway", "CodespecEngine")
    assert gateway.init_args[2] == ("k1", "k2")  # /replicas checks the keys itself
    assert engine.num_replicas == 3 and engine.ray_actor_options == {"num_cpus": 0.5, "num_gpus": 0.0}
    config = engine._deployment_config
    assert config.max_ongoing_requests == 12 and config.max_queued_requests == 8  # parallel + queue; queue
    router = config.request_router_config
    assert router.request_router_class == "codespec.replicas.router.SessionRouter"
    assert router.request_router_kwargs == {"spill_at": 4}  # saturated: every engine turn taken
    settings = engine.init_args[0]
    assert settings.server.parallel == 4 and settings.threads == 1 and settings.model.model == str(tiny_dir)


def test_serve_replicas_options_parse_and_are_checked():
    args = build_parser().parse_args(["serve", "--replicas", "2", "--replica-cpus", "1", "--ray-address", "auto"])
    assert (args.replicas, args.replica_cpus, args.replica_gpus, args.ray_address) == (2, 1.0, 0.0, "auto")
    assert build_parser().parse_args(["serve"]).replicas == 0
    bad = build_parser().parse_args(["serve", "--replicas", "2", "--read-timeout", "0"])
    with pytest.raises(CodespecError, match="read-timeout"):
        build_app(bad, 2)
