"""The Kubernetes manifests: every overlay renders and validates, and what they say agrees
with `tgis serve` (settings, ports, probes, metrics, the image's entrypoint and user)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tgis.config import ENV_NAMES, LauncherArgs, ModelFacts, build_serve_config
from tgis.server import Metrics

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_deploy", ROOT / "scripts" / "check_deploy.py")
assert _spec is not None and _spec.loader is not None
check_deploy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_deploy)

# Variables tgis reads besides its launcher settings' (huggingface_hub's cache and mode).
OTHER_ENV = {"HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "WARMUP_ENABLED"}


def rendered(overlay: str) -> dict[str, dict[str, Any]]:
    objects = check_deploy.render(ROOT / "deploy" / "kubernetes" / "overlays" / overlay, False)
    return {obj["kind"]: obj for obj in objects}


@pytest.fixture(params=check_deploy.OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    return rendered(request.param)


def container(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (only,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


def test_every_overlay_renders_valid_objects(overlay: dict[str, dict[str, Any]]) -> None:
    check_deploy.validate(list(overlay.values()))
    assert set(overlay) == {
        "ConfigMap", "Deployment", "Service", "PersistentVolumeClaim", "PodDisruptionBudget",
        "HorizontalPodAutoscaler", "ServiceMonitor",
    }  # fmt: skip


def test_validation_refuses_what_kubernetes_would() -> None:
    objects = rendered("cpu")
    broken = dict(objects["Deployment"])
    broken["spec"] = {**broken["spec"], "replica": 2}  # a typo of `replicas`
    with pytest.raises(ValueError, match="Deployment/tgis"):
        check_deploy.validate([broken])
    monitor = {**objects["ServiceMonitor"], "spec": {"selector": {"matchLabels": {"a": "b"}}}}
    with pytest.raises(ValueError, match="endpoint"):
        check_deploy.validate([monitor])


def test_settings_are_ones_tgis_serve_reads_and_accepts(
    overlay: dict[str, dict[str, Any]],
) -> None:
    env = overlay["ConfigMap"]["data"]
    unknown = set(env) - set(ENV_NAMES.values()) - OTHER_ENV
    assert not unknown, f"variables tgis does not read: {unknown}"
    config = build_serve_config(LauncherArgs(), ModelFacts("llama", 8192), env)
    assert config.port == int(env["PORT"]) and config.grpc_port == int(env["GRPC_PORT"])
    assert config.hostname == "0.0.0.0"
    assert config.backend == env["TGIS_BACKEND"] == ("cpu" if "cpu" in str(env) else "cuda")


def test_ports_probes_and_service_agree(overlay: dict[str, dict[str, Any]]) -> None:
    env = overlay["ConfigMap"]["data"]
    c = container(overlay)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": int(env["PORT"]), "grpc": int(env["GRPC_PORT"])}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # The startup probe leaves time for loading and warmup (minutes, not seconds).
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    service = overlay["Service"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    pod_labels = overlay["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    selector = overlay["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    monitor = overlay["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [(e["port"], e["path"]) for e in monitor["endpoints"]] == [("http", "/metrics")]


def test_the_autoscaler_scales_the_deployment_on_a_metric_tgis_exports(
    overlay: dict[str, dict[str, Any]],
) -> None:
    hpa = overlay["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == overlay["Deployment"]["metadata"]["name"]
    (metric,) = hpa["metrics"]
    name = metric["external"]["metric"]["name"]
    exported = {family.name for family in Metrics().registry.collect()}
    assert name == "tgi_queue_size" and name in exported


def test_the_pod_runs_the_images_entrypoint_as_its_user(
    overlay: dict[str, dict[str, Any]],
) -> None:
    c = container(overlay)
    assert "command" not in c and "args" not in c  # the image's `tgis serve`
    image = c["image"].split(":")[0]
    dockerfile = ROOT / f"Dockerfile.{image.removeprefix('tgis-')}"
    text = dockerfile.read_text()
    assert 'ENTRYPOINT ["tgis", "serve"]' in text and "USER 1000:1000" in text
    pod = overlay["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 1000
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    # SIGTERM's drain (--shutdown-grace, 30 s by default) ends before Kubernetes kills.
    assert pod["terminationGracePeriodSeconds"] > 30
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert overlay["ConfigMap"]["data"]["HF_HOME"] in mounts


def test_gpus_asked_match_the_shards() -> None:
    assert "nvidia.com/gpu" not in str(container(rendered("cpu"))["resources"])
    assert container(rendered("cuda"))["resources"]["limits"]["nvidia.com/gpu"] == 1
    multi = rendered("cuda-multi-gpu")
    shards = int(multi["ConfigMap"]["data"]["NUM_SHARD"])
    assert container(multi)["resources"]["limits"]["nvidia.com/gpu"] == shards == 2
    mounts = {m["mountPath"] for m in container(multi)["volumeMounts"]}
    assert "/dev/shm" in mounts  # NCCL's shared memory
