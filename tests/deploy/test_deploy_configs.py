"""The shipped deploy files parse and validate exactly as Ray and our config models will read them."""

from pathlib import Path

import yaml

from cluster.config import AppConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_serve_yaml_args_are_a_valid_app_config():
    doc = yaml.safe_load((DEPLOY / "serve.yaml").read_text())
    (app,) = doc["applications"]
    assert app["import_path"] == "cluster.actors.app:build_app"
    cfg = AppConfig.model_validate(app["args"])
    assert cfg.models[0].source == "mlx-community/Qwen3-4B-4bit"
    assert doc["http_options"]["host"] == "0.0.0.0"


def test_the_sharded_example_spans_two_macs_per_replica():
    from cluster.actors.app import placement

    doc = yaml.safe_load((DEPLOY / "serve-sharded.yaml").read_text())
    (app,) = doc["applications"]
    [model] = AppConfig.model_validate(app["args"]).models
    assert (model.shards, model.shard_mode) == (2, "tensor")
    assert placement(model, nodes=4) == {"num_replicas": 2, "placement_group_bundles": [{"mlx_fleet": 0.6}] * 2,
                                         "placement_group_strategy": "STRICT_SPREAD"}


def test_the_jaccl_example_is_the_sharded_one_over_rdma():
    def models(name):
        (app,) = yaml.safe_load((DEPLOY / name).read_text())["applications"]
        return AppConfig.model_validate(app["args"]).models

    [ring], [jaccl] = models("serve-sharded.yaml"), models("serve-sharded-jaccl.yaml")
    assert (ring.shard_backend, jaccl.shard_backend) == ("ring", "jaccl")
    assert jaccl.model_copy(update={"shard_backend": "ring"}) == ring


def test_serve_yaml_import_path_resolves():
    import importlib

    module, attr = "cluster.actors.app:build_app".split(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_cluster_yaml_passes_ray_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    assert raw["provider"]["type"] == "local" and raw["provider"]["head_ip"] and raw["provider"]["worker_ips"]
    validate_config(prepare_config(raw))
    starts = " ".join(raw["head_start_ray_commands"] + raw["worker_start_ray_commands"])
    assert starts.count('"mlx_fleet": 1') == 2
    assert "fleet-env.sh" in starts


def test_fleet_env_opts_macs_into_multi_node_ray():
    env = (DEPLOY / "bootstrap" / "fleet-env.sh").read_text()
    for needed in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1", "RAY_AUTH_MODE=token", "MLX_FLEET_NODE_NAME"):
        assert needed in env


def test_fleet_env_runs_serve_as_a_local_fleet_does():
    """A fleet of Macs and `mlx-fleet up` run the same Serve data plane (direct gRPC, no direct ingress)."""
    from cluster.fleet.ray_env import SERVE_ENV

    exports = dict(line.removeprefix("export ").split("=", 1)
                   for line in (DEPLOY / "bootstrap" / "fleet-env.sh").read_text().splitlines()
                   if line.startswith("export RAY_SERVE_"))
    assert {k: v for k, v in exports.items() if k in SERVE_ENV} == SERVE_ENV
    assert SERVE_ENV == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
                         "RAY_SERVE_PROXY_USE_GRPC": "1"}
