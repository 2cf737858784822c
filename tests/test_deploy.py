"""The Kubernetes manifests: every overlay renders and validates, and what they say agrees
with `tgis serve` (settings, ports, probes, metrics, the image's entrypoint and user); the
multi-node overlay's LeaderWorkerSet gives each pod its node and the leader's address."""

from __future__ import annotations

import copy
import importlib.util
import re
import shutil
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
# LeaderWorkerSet's pod labels (kubernetes-sigs/lws, api/leaderworkerset/v1) and the variables
# its pod webhook puts first in every container's env (pkg/utils/pod/pod_utils.go).
LWS = "leaderworkerset.sigs.k8s.io/"
LWS_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")


def rendered(overlay: str) -> dict[str, dict[str, Any]]:
    objects = check_deploy.render(ROOT / "deploy" / "kubernetes" / "overlays" / overlay, False)
    return {obj["kind"]: obj for obj in objects}


@pytest.fixture(params=check_deploy.OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    return rendered(request.param)


def workload(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What runs the pods: the Deployment, or the LeaderWorkerSet of a multi-node overlay."""
    return objects["Deployment"] if "Deployment" in objects else objects["LeaderWorkerSet"]


def roles(objects: dict[str, dict[str, Any]]) -> tuple[str, ...]:
    return ("leader",) if "Deployment" in objects else ("leader", "worker")


def pod_template(objects: dict[str, dict[str, Any]], role: str = "leader") -> dict[str, Any]:
    if "Deployment" in objects:
        assert role == "leader"
        return objects["Deployment"]["spec"]["template"]
    group = objects["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    # Without a leaderTemplate, the leader is made from the workerTemplate.
    return group.get(f"{role}Template") or group["workerTemplate"]


def container(objects: dict[str, dict[str, Any]], role: str = "leader") -> dict[str, Any]:
    (only,) = pod_template(objects, role)["spec"]["containers"]
    return only


def pod_labels(
    objects: dict[str, dict[str, Any]], role: str = "leader", group: int = 0, index: int = 1
) -> dict[str, str]:
    """A pod's labels as its controller creates it: the template's, and LeaderWorkerSet's
    (group `group`; a worker is `index` 1 to size - 1, the leader 0)."""
    labels = dict(pod_template(objects, role)["metadata"]["labels"])
    if "LeaderWorkerSet" in objects:
        labels[LWS + "name"] = objects["LeaderWorkerSet"]["metadata"]["name"]
        labels[LWS + "group-index"] = str(group)
        labels[LWS + "worker-index"] = "0" if role == "leader" else str(index)
    return labels


def leader_address(lws: dict[str, Any], group: int, namespace: str) -> str:
    """LWS_LEADER_ADDRESS as LeaderWorkerSet sets it: the leader pod (its StatefulSet's pod
    `group`, named NAME-GROUP) under the headless Service its pods' subdomain names."""
    name = lws["metadata"]["name"]
    policy = lws["spec"].get("networkConfig", {}).get("subdomainPolicy", "Shared")
    subdomain = name if policy == "Shared" else f"{name}-{group}"
    return f"{name}-{group}.{subdomain}.{namespace}"


def pod_env(
    objects: dict[str, dict[str, Any]],
    role: str = "leader",
    group: int = 0,
    index: int = 1,
    namespace: str = "llm",
    pod_ip: str = "10.1.2.3",
) -> dict[str, str]:
    """The environment the pod's container starts with, as the kubelet resolves it: the
    ConfigMap (envFrom), then `env` in order (LeaderWorkerSet's variables first), each
    downward-API value read from the pod and each $(NAME) from the variables before it."""
    c = container(objects, role)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        assert source["configMapRef"]["name"] == objects["ConfigMap"]["metadata"]["name"]
        env.update(objects["ConfigMap"]["data"])
    labels = pod_labels(objects, role, group, index)
    fields = {f"metadata.labels['{k}']": v for k, v in labels.items()}
    fields |= {"metadata.namespace": namespace, "status.podIP": pod_ip}
    entries = list(c.get("env", []))
    if "LeaderWorkerSet" in objects:
        lws = objects["LeaderWorkerSet"]
        size = str(lws["spec"]["leaderWorkerTemplate"]["size"])
        values = (leader_address(lws, group, namespace), size, labels[LWS + "worker-index"])
        injected = [{"name": n, "value": v} for n, v in zip(LWS_ENV, values, strict=True)]
        entries = injected + [e for e in entries if e["name"] not in LWS_ENV]

    def expand(reference: re.Match[str]) -> str:
        return env.get(reference[1], reference[0])  # a name not defined yet stays as written

    for entry in entries:
        if "valueFrom" in entry:
            env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            assert "$$" not in entry["value"]
            env[entry["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, entry["value"])
    return env


def test_every_overlay_renders_valid_objects(overlay: dict[str, dict[str, Any]]) -> None:
    check_deploy.validate(list(overlay.values()))
    assert set(overlay) == {
        "ConfigMap", workload(overlay)["kind"], "Service", "PersistentVolumeClaim",
        "PodDisruptionBudget", "HorizontalPodAutoscaler", "ServiceMonitor",
    }  # fmt: skip
    multi_node = int(overlay["ConfigMap"]["data"].get("NNODES", "1")) > 1
    assert workload(overlay)["kind"] == ("LeaderWorkerSet" if multi_node else "Deployment")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("name", check_deploy.OVERLAYS)
def test_the_renderer_renders_what_kubectl_kustomize_does(name: str) -> None:
    directory = ROOT / "deploy" / "kubernetes" / "overlays" / name

    def key(obj: dict[str, Any]) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    ours = sorted(check_deploy.render(directory, False), key=key)
    assert ours == sorted(check_deploy.render(directory, True), key=key)


def test_the_renderers_merge_is_kustomizes() -> None:
    base = {"env": [{"name": n, "value": n.lower()} for n in "ABC"], "drop": 1, "keep": 2}
    patch = {"env": [{"name": "D", "value": "4"}, {"name": "B", "value": "x"}], "drop": None}
    # A strategic merge (the API's own kinds): the patch's items first, then the rest.
    merged = check_deploy._merge(base, patch)
    assert [(e["name"], e["value"]) for e in merged["env"]] == [
        ("D", "4"), ("B", "x"), ("A", "a"), ("C", "c"),
    ]  # fmt: skip
    assert merged.keys() == {"env", "keep"}
    # A JSON merge patch (custom resources): lists are replaced.
    assert check_deploy._merge(base, patch, strategic=False)["env"] == patch["env"]


def test_validation_refuses_what_kubernetes_would() -> None:
    objects = rendered("cpu")
    broken = dict(objects["Deployment"])
    broken["spec"] = {**broken["spec"], "replica": 2}  # a typo of `replicas`
    with pytest.raises(ValueError, match="Deployment/tgis"):
        check_deploy.validate([broken])
    monitor = {**objects["ServiceMonitor"], "spec": {"selector": {"matchLabels": {"a": "b"}}}}
    with pytest.raises(ValueError, match="endpoint"):
        check_deploy.validate([monitor])


def test_validation_refuses_a_broken_leader_worker_set() -> None:
    objects = rendered("cuda-multi-node")
    lws = objects["LeaderWorkerSet"]
    check_deploy.validate([lws])

    def broken(change: Any) -> dict[str, Any]:
        copied = copy.deepcopy(lws)
        change(copied["spec"]["leaderWorkerTemplate"])
        return copied

    no_size = broken(lambda group: group.pop("size"))
    with pytest.raises(ValueError, match=r"LeaderWorkerSet/tgis-nodes: .*size is required"):
        check_deploy.validate([no_size])
    # A typo inside the worker's container: the template is validated as the Pod it becomes.
    typo = broken(lambda group: group["workerTemplate"]["spec"]["containers"][0].update(imag="x"))
    with pytest.raises(ValueError, match=r"LeaderWorkerSet/tgis-nodes: .*workerTemplate.*'imag'"):
        check_deploy.validate([typo])
    for change, problem in (
        (lambda group: group.update(size=0), "size must be an integer of at least 1"),
        (lambda group: group.update(sizes=2), "unknown fields"),
        (lambda group: group.update(restartPolicy="Always"), "restartPolicy is 'Always'"),
        (lambda group: group.pop("workerTemplate"), "workerTemplate is required"),
    ):
        with pytest.raises(ValueError, match=f"LeaderWorkerSet/tgis-nodes: .*{problem}"):
            check_deploy.validate([broken(change)])
    # The LeaderWorkerSet's own headless Service, which gives the leader its DNS name, would
    # not be created beside a Service of its name.
    clash = {**objects["Service"], "metadata": {"name": lws["metadata"]["name"]}}
    with pytest.raises(ValueError, match="LeaderWorkerSet/tgis-nodes: a Service of the same name"):
        check_deploy.validate([lws, clash])


def test_settings_are_ones_tgis_serve_reads_and_accepts(
    overlay: dict[str, dict[str, Any]],
) -> None:
    for role in roles(overlay):
        env = pod_env(overlay, role)
        own = {e["name"] for e in container(overlay, role).get("env", [])}
        # Variables of the pod's own that tgis does not read only compose one it does.
        composing = {n for n in own if f"$({n})" in str(container(overlay, role)["env"])}
        unknown = set(env) - set(ENV_NAMES.values()) - OTHER_ENV - composing - set(LWS_ENV)
        assert not unknown, f"variables tgis does not read: {unknown}"
        config = build_serve_config(LauncherArgs(), ModelFacts("llama", 8192), env)
        assert config.port == int(env["PORT"]) and config.grpc_port == int(env["GRPC_PORT"])
        assert config.hostname == "0.0.0.0"
        assert config.backend == env["TGIS_BACKEND"] == ("cpu" if "cpu" in str(env) else "cuda")
        assert config.nnodes == int(env.get("NNODES", "1"))
        assert config.node_rank == (0 if role == "leader" else 1)


def test_ports_probes_and_service_agree(overlay: dict[str, dict[str, Any]]) -> None:
    env = overlay["ConfigMap"]["data"]
    c = container(overlay)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    served = {"http": int(env["PORT"]), "grpc": int(env["GRPC_PORT"])}
    if int(env.get("NNODES", "1")) > 1:  # node 0 hosts the other nodes' rendezvous
        assert ports == {**served, "rendezvous": int(env["MASTER_PORT"])}
        ports = served
    assert ports == served
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # The startup probe leaves time for loading and warmup (minutes, not seconds).
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    service = overlay["Service"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    labels = pod_labels(overlay)
    assert service["spec"]["selector"].items() <= labels.items()
    selector = overlay["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    monitor = overlay["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [(e["port"], e["path"]) for e in monitor["endpoints"]] == [("http", "/metrics")]


def test_the_autoscaler_scales_the_workload_on_a_metric_tgis_exports(
    overlay: dict[str, dict[str, Any]],
) -> None:
    hpa = overlay["HorizontalPodAutoscaler"]["spec"]
    target = workload(overlay)
    assert hpa["scaleTargetRef"] == {
        "apiVersion": target["apiVersion"], "kind": target["kind"],
        "name": target["metadata"]["name"],
    }  # fmt: skip
    (metric,) = hpa["metrics"]
    name = metric["external"]["metric"]["name"]
    exported = {family.name for family in Metrics().registry.collect()}
    assert name == "tgi_queue_size" and name in exported


def test_the_pod_runs_the_images_entrypoint_as_its_user(
    overlay: dict[str, dict[str, Any]],
) -> None:
    for role in roles(overlay):
        c = container(overlay, role)
        assert "command" not in c and "args" not in c  # the image's `tgis serve`
        image = c["image"].split(":")[0]
        dockerfile = ROOT / f"Dockerfile.{image.removeprefix('tgis-')}"
        text = dockerfile.read_text()
        assert 'ENTRYPOINT ["tgis", "serve"]' in text and "USER 1000:1000" in text
        pod = pod_template(overlay, role)["spec"]
        context = pod["securityContext"]
        assert context["runAsNonRoot"] and context["runAsUser"] == 1000
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
    nodes = rendered("cuda-multi-node")
    env = nodes["ConfigMap"]["data"]
    per_node = int(env["NUM_SHARD"]) // int(env["NNODES"])
    assert per_node * int(env["NNODES"]) == int(env["NUM_SHARD"])
    for role in roles(nodes):
        assert container(nodes, role)["resources"]["limits"]["nvidia.com/gpu"] == per_node == 8
        assert "/dev/shm" in {m["mountPath"] for m in container(nodes, role)["volumeMounts"]}


# The multi-node overlay: one model over two hosts, a LeaderWorkerSet group per replica.


def test_a_group_is_one_pod_per_node() -> None:
    nodes = rendered("cuda-multi-node")
    spec = nodes["LeaderWorkerSet"]["spec"]
    assert spec["leaderWorkerTemplate"]["size"] == int(nodes["ConfigMap"]["data"]["NNODES"]) == 2
    # The leader is ready only once every node has joined: its workers start with it.
    assert spec["startupPolicy"] == "LeaderCreated"
    # The nodes of a server stop together, and start again together.
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    # The workers' MASTER_ADDR is the leader's name under the one shared headless Service.
    assert spec["networkConfig"]["subdomainPolicy"] == "Shared"


def test_each_pod_knows_its_node_and_the_leader() -> None:
    nodes = rendered("cuda-multi-node")
    lws = nodes["LeaderWorkerSet"]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    for role in roles(nodes):
        (rank,) = [e for e in container(nodes, role)["env"] if e["name"] == "NODE_RANK"]
        path = f"metadata.labels['{LWS}worker-index']"
        assert rank["valueFrom"] == {"fieldRef": {"fieldPath": path}}
    # The leader is node 0 and hosts the rendezvous at its own address.
    leader = pod_env(nodes, "leader", pod_ip="10.1.2.3")
    assert (leader["NODE_RANK"], leader["MASTER_ADDR"]) == ("0", "10.1.2.3")
    config = build_serve_config(LauncherArgs(), ModelFacts("llama", 8192), leader)
    assert (config.nnodes, config.node_rank, config.master_addr) == (2, 0, "10.1.2.3")
    # Each worker is node 1 to size - 1, and meets its own group's leader: the pod
    # LeaderWorkerSet names NAME-GROUP, under the headless Service NAME.
    for group, namespace in ((0, "llm"), (3, "prod")):
        for index in range(1, size):
            worker = pod_env(nodes, "worker", group, index, namespace)
            assert worker["NODE_RANK"] == str(index)
            address = worker["MASTER_ADDR"]
            assert address == f"tgis-nodes-{group}.tgis-nodes.{namespace}"
            assert address == worker["LWS_LEADER_ADDRESS"] == leader_address(lws, group, namespace)
    worker = pod_env(nodes, "worker")
    config = build_serve_config(LauncherArgs(), ModelFacts("llama", 8192), worker)
    assert (config.nnodes, config.node_rank) == (2, 1)
    assert config.master_addr == "tgis-nodes-0.tgis-nodes.llm"
    assert config.master_port == int(worker["MASTER_PORT"]) == 29500
    assert config.num_shard == 16


def test_only_leaders_serve() -> None:
    nodes = rendered("cuda-multi-node")
    service = nodes["Service"]["spec"]["selector"]
    budget = nodes["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]
    leader, worker = pod_labels(nodes, "leader"), pod_labels(nodes, "worker")
    assert service.items() <= leader.items() and not service.items() <= worker.items()
    assert service[LWS + "worker-index"] == "0"
    # Drains take one pod of either role at a time.
    assert budget.items() <= leader.items() and budget.items() <= worker.items()
    c = container(nodes, "worker")
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe"} & set(c)


def test_the_leader_runs_the_cuda_overlays_container() -> None:
    single, nodes = rendered("cuda"), rendered("cuda-multi-node")
    one, leader = container(single), container(nodes)
    for key in ("image", "envFrom", "startupProbe", "readinessProbe", "livenessProbe"):
        assert leader[key] == one[key], key
    assert leader["securityContext"] == one["securityContext"]
    assert all(mount in leader["volumeMounts"] for mount in one["volumeMounts"])
    pod, leader_pod = pod_template(single)["spec"], pod_template(nodes)["spec"]
    for key in ("securityContext", "tolerations", "terminationGracePeriodSeconds"):
        assert leader_pod[key] == pod[key], key
    assert all(volume in leader_pod["volumes"] for volume in pod["volumes"])
    # The worker: the same pod, less what serves, and its own way to the leader.
    worker_pod = pod_template(nodes, "worker")["spec"]
    assert {**worker_pod, "containers": None} == {**leader_pod, "containers": None}
    serving = {"ports", "startupProbe", "readinessProbe", "livenessProbe", "env"}
    worker = container(nodes, "worker")
    assert {k: v for k, v in leader.items() if k not in serving} == {
        k: v for k, v in worker.items() if k != "env"
    }
