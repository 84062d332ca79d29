"""The deployment files parse and say what the code has: each against the schema of the tool
that reads it (KubeRay's CRD, Ray Serve's config schema, Ray's cluster-config schema), and
against tandem itself (the import path, the config fields, the model, the image)."""

import copy
import functools
import importlib
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from cluster.serve.config import load_config
from workers.catalog import CATALOG, DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CRDS = Path(__file__).resolve().parent / "crds"  # the project's copy (crds/README.md)
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"tandem:{VERSION}"


def load(name: str) -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / name).read_text()))


def rayservice() -> dict:
    return next(doc for doc in load("rayservice.yaml") if doc["kind"] == "RayService")


@functools.cache
def crd_schema(name: str) -> dict:
    # a megabyte of YAML: libyaml's loader reads it in a fraction of the pure-Python one's time
    crd = yaml.load((CRDS / name).read_text(), Loader=getattr(yaml, "CSafeLoader",
                                                              yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("name", ["serve.yaml", "serve-cluster.yaml"])
def test_serve_configs_pass_serves_schema_and_build_tandems_config(name):
    config = ServeDeploySchema.model_validate(load(name)[0])
    for app in config.applications:
        module, _, attribute = app.import_path.partition(":")
        assert callable(getattr(importlib.import_module(module), attribute))
        load_config(dict(app.args))  # every arg is a ServeConfig field with a valid value


def test_the_rayservice_passes_kuberays_crd_and_runs_the_cluster_serve_config():
    service = rayservice()
    jsonschema.validate(service, crd_schema("ray.io_rayservices.yaml"))
    # the app is the one `serve deploy` gets on a `ray up` cluster, word for word
    assert service["spec"]["serveConfigV2"] == (DEPLOY / "serve-cluster.yaml").read_text()
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"][
        "serveConfigV2"]))
    app = serve_config.applications[0]
    assert app.import_path == "cluster.serve.app:app_builder"
    args = load_config(dict(app.args))
    assert args.model == DEFAULT_MODEL and args.device == "cuda"
    assert args.autoscaling is not None and args.autoscaling.min_replicas >= 1
    # the ingress scales with Serve's own autoscaling, by its deployment's name
    assert [(d.name, d.num_replicas) for d in app.deployments] == [("tandem", "auto")]
    assert service["spec"]["upgradeStrategy"]["type"] in ("NewCluster",
                                                          "NewClusterWithIncrementalUpgrade")


def test_the_head_runs_no_gpu_work_and_the_gpu_group_autoscales_from_zero():
    cluster = rayservice()["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["version"] == "v2"
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    head_container = head["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head_container["resources"]["limits"]
    assert env_of(head_container)["RAY_enable_autoscaler_v2"] == "1"
    [gpu] = cluster["workerGroupSpecs"]
    worker = gpu["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert gpu["minReplicas"] == 0
    args = load_config(dict(yaml.safe_load(rayservice()["spec"]["serveConfigV2"])[
        "applications"][0]["args"]))
    assert args.autoscaling is not None
    # room for every engine replica tandem may ask for, one GPU a pod
    assert gpu["maxReplicas"] >= args.autoscaling.max_replicas * args.tensor_parallel_size
    for container in (head_container, worker):
        assert container["image"] == IMAGE
        env = env_of(container)
        assert (env["RAY_SERVE_THROUGHPUT_OPTIMIZED"], env["RAY_SERVE_ENABLE_HA_PROXY"]) == (
            "1", "1")
        assert env["TANDEM_CACHE_DIR"] == "/opt/tandem/cache"


def test_prometheus_scrapes_metrics_once_on_the_heads_serve_port():
    [monitor] = [doc for doc in load("rayservice.yaml") if doc["kind"] == "PodMonitor"]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    head = rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    http_port = yaml.safe_load(rayservice()["spec"]["serveConfigV2"])["http_options"]["port"]
    assert ports[endpoint["port"]] == http_port
    selector = monitor["spec"]["selector"]["matchLabels"]
    # KubeRay labels the head pod ray.io/node-type=head; the rest are the template's own
    assert selector.pop("ray.io/node-type") == "head"
    assert selector.items() <= head["metadata"]["labels"].items()


def test_the_ray_up_config_passes_rays_own_validation():
    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` checks first
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"]["GPU"] == 0
    assert any("--num-gpus=0" in command for command in config["head_start_ray_commands"])
    workers = {name: t for name, t in types.items() if name != config["head_node_type"]}
    assert workers and all(t["min_workers"] == 0 and t["max_workers"] >= 1
                           for t in workers.values())
    assert config["max_workers"] == sum(t["max_workers"] for t in workers.values())
    assert config["docker"]["image"] == IMAGE
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        start = commands[-1]
        assert "RAY_SERVE_THROUGHPUT_OPTIMIZED=1" in start and "ray start" in start


def test_the_dockerfile_builds_on_cuda_and_pulls_the_default_model_through_the_catalog():
    lines = [line.strip() for line in (DEPLOY / "Dockerfile").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert lines[0].startswith("FROM nvidia/cuda:")
    args = {line.split()[1].split("=")[0]: line.split("=", 1)[1] for line in lines
            if line.startswith("ARG ")}
    assert args["TORCH_SPEC"].startswith("torch==") and args["TRITON_SPEC"].startswith(
        "triton==")
    assert args["MODEL"] == DEFAULT_MODEL and DEFAULT_MODEL in CATALOG
    assert any(line.startswith('RUN tandem models pull "$MODEL"') for line in lines)
    assert 'RUN pip install --no-cache-dir ".[triton]"' in lines
    assert lines[-2:] == ['ENTRYPOINT ["tandem", "serve"]', 'CMD ["--host", "0.0.0.0", '
                          '"--port", "8000"]']
    # the Makefile's versions are the image's
    makefile = (ROOT / "Makefile").read_text()
    assert f"TORCH_SPEC ?= {args['TORCH_SPEC']}" in makefile
    assert f"TRITON_SPEC ?= {args['TRITON_SPEC']}" in makefile


@pytest.mark.ray
def test_serve_builds_the_cluster_app_and_its_override_autoscales_the_ingress(ray_session):
    # what Serve's controller does with a config file (ray is pinned: these are its own steps)
    from ray.serve._private.application_state import (
        build_serve_application,
        override_deployment_info,
    )
    from ray.serve._private.deploy_utils import deploy_args_to_deployment_info
    from ray.serve.schema import LoggingConfig

    [app] = ServeDeploySchema.model_validate(load("serve-cluster.yaml")[0]).applications
    _, deploy_args, error = ray_session.get(build_serve_application.remote(
        app.import_path, "v1", app.name, app.args, LoggingConfig(), None, {}, {}, {}))
    assert error is None
    infos = {args["deployment_name"]: deploy_args_to_deployment_info(**args, app_name=app.name)
             for args in deploy_args}
    configs = {name: info.deployment_config
               for name, info in override_deployment_info(infos, app).items()}
    # the engines' host stays one replica (tandem scales the engines), the ingress is Serve's
    assert configs["tandem-engines"].num_replicas == 1
    assert configs["tandem-engines"].autoscaling_config is None
    ingress = configs["tandem"].autoscaling_config
    assert (ingress.min_replicas, ingress.max_replicas, ingress.target_ongoing_requests) == (
        2, 8, 256)
