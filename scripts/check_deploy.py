"""Render every Kubernetes overlay under deploy/kubernetes and validate what it renders.

    python scripts/check_deploy.py            # part of `make lint`
    python scripts/check_deploy.py --print cuda

Rendering uses `kubectl kustomize` where kubectl is installed, else the small renderer below,
which implements the part of kustomize the overlays use: `resources` (files and directories),
`labels` (with `includeSelectors`) and `patches` given by `path`: a strategic merge for the
Kubernetes API's own kinds (maps merge, lists of named items merge by name, the patch's items
first, other lists are replaced), a JSON merge patch for custom resources (every list is
replaced), and `$patch: delete` at a patch's top, which removes the object. Every rendered
object is then validated against the Kubernetes API schemas of `kubernetes-validate` (strict:
unknown fields are errors). Two custom resources those schemas lack are checked here: the
Prometheus Operator's ServiceMonitor against the fields it must have, and the LeaderWorkerSet
(https://github.com/kubernetes-sigs/lws, API leaderworkerset.x-k8s.io/v1) field by field, its
leader and worker pod templates strictly as the Pods they become.
"""

from __future__ import annotations

import argparse
import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "cuda", "cuda-multi-gpu", "cuda-multi-node")
KUBERNETES_VERSION = "1.32"


def render(directory: Path, use_kubectl: bool | None = None) -> list[dict[str, Any]]:
    """The objects the kustomization in `directory` renders."""
    if use_kubectl is None:
        use_kubectl = shutil.which("kubectl") is not None
    if use_kubectl:
        out = subprocess.run(
            ["kubectl", "kustomize", str(directory)], check=True, capture_output=True, text=True
        ).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]
    return _render(directory)


def _render(directory: Path) -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {"apiVersion", "kind", "resources", "labels", "patches"}
    if unknown:
        raise ValueError(f"{directory}: kustomization fields this renderer lacks: {unknown}")
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects.extend(_render(path))
        else:
            objects.extend(_plain(doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"{directory}: only `path` patches are rendered here: {patch}")
        for doc in yaml.safe_load_all((directory / patch["path"]).read_text()):
            target = _find(objects, doc)
            directive = doc.get("$patch")
            if directive == "delete":
                objects.remove(target)
                continue
            if directive is not None or _directives(doc):
                raise ValueError(f"{directory}: only a top-level `$patch: delete` is rendered here")
            merged = _merge(target, _plain(doc), strategic=_builtin(target))
            objects[objects.index(target)] = merged
    for labels in kustomization.get("labels", []):
        for obj in objects:
            _label(obj, labels["pairs"], labels.get("includeSelectors", False))
    return objects


def _find(objects: list[dict[str, Any]], patch: dict[str, Any]) -> dict[str, Any]:
    for obj in objects:
        if (obj["kind"], obj["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"]):
            return obj
    raise ValueError(f"patch of {patch['kind']}/{patch['metadata']['name']}: no such object")


def _plain(doc: Any) -> Any:
    """`doc` without YAML's aliases: every map and list its own (as kustomize expands them)."""
    if isinstance(doc, dict):
        return {key: _plain(value) for key, value in doc.items()}
    if isinstance(doc, list):
        return [_plain(value) for value in doc]
    return doc


def _directives(doc: Any) -> bool:
    """Whether `doc` holds a strategic merge directive (`$patch`, `$retainKeys`, ...)."""
    if isinstance(doc, dict):
        return any(str(k).startswith("$") or _directives(v) for k, v in doc.items())
    return isinstance(doc, list) and any(_directives(v) for v in doc)


def _builtin(obj: dict[str, Any]) -> bool:
    """Whether `obj` is of the Kubernetes API's own kinds (whose schemas kustomize knows), not a
    custom resource: core (`v1`) and groups without a dot or under k8s.io."""
    group = obj["apiVersion"].rpartition("/")[0]
    return "." not in group or group.endswith(".k8s.io")


def _merge(base: Any, patch: Any, strategic: bool = True) -> Any:
    """Strategic merge (maps merge, lists of named items merge by name, the patch's items
    first, as kustomize orders them), or with `strategic` false a JSON merge patch (lists are
    replaced); a null value removes its key."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = (
                    _merge(out[key], value, strategic) if key in out else copy.deepcopy(value)
                )
        return out
    if strategic and isinstance(base, list) and isinstance(patch, list) and _named(base + patch):
        existing = {item["name"]: item for item in base}
        out = [_merge(existing.get(item["name"], {}), item, strategic) for item in patch]
        patched = {item["name"] for item in patch}
        return out + [copy.deepcopy(item) for item in base if item["name"] not in patched]
    return copy.deepcopy(patch)


def _named(items: list[Any]) -> bool:
    return all(isinstance(i, dict) and "name" in i for i in items)


def _label(obj: dict[str, Any], pairs: dict[str, str], selectors: bool) -> None:
    obj["metadata"].setdefault("labels", {}).update(pairs)
    if not selectors:
        return
    spec = obj.get("spec", {})
    if obj["kind"] in ("Deployment", "StatefulSet", "PodDisruptionBudget"):
        spec.setdefault("selector", {}).setdefault("matchLabels", {}).update(pairs)
    if obj["kind"] in ("Deployment", "StatefulSet"):
        spec["template"].setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
    if obj["kind"] == "Service":
        spec.setdefault("selector", {}).update(pairs)


def validate(objects: list[dict[str, Any]]) -> None:
    """Raise ValueError on the first object that does not fit its schema."""
    for obj in objects:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        if obj.get("kind") == "ServiceMonitor":
            _check_service_monitor(obj, name)
            continue
        if obj.get("kind") == "LeaderWorkerSet":
            _check_leader_worker_set(obj, name)
            continue
        _validate_as(obj, name)
    services = {o["metadata"]["name"] for o in objects if o.get("kind") == "Service"}
    for obj in objects:
        if obj.get("kind") == "LeaderWorkerSet" and obj["metadata"]["name"] in services:
            raise ValueError(
                f"LeaderWorkerSet/{obj['metadata']['name']}: a Service of the same name is "
                "rendered too, where the LeaderWorkerSet creates a headless Service of its own "
                "name to give its pods DNS names (the leader's among them)"
            )


def _check_service_monitor(obj: dict[str, Any], name: str) -> None:
    if obj.get("apiVersion") != "monitoring.coreos.com/v1":
        raise ValueError(f"{name}: apiVersion must be monitoring.coreos.com/v1")
    spec = obj.get("spec", {})
    if not spec.get("selector", {}).get("matchLabels"):
        raise ValueError(f"{name}: spec.selector.matchLabels is needed")
    endpoints = spec.get("endpoints") or []
    allowed = {"port", "path", "interval", "scrapeTimeout", "scheme"}
    if not endpoints or any(not e.get("port") or set(e) - allowed for e in endpoints):
        raise ValueError(f"{name}: each endpoint needs a port, and only {sorted(allowed)}")


# The LeaderWorkerSet's API (api/leaderworkerset/v1/leaderworkerset_types.go of
# kubernetes-sigs/lws) and what its admission webhook refuses: the fields each map may hold,
# the enums, and the integers' least values. Its pod templates are corev1 PodTemplateSpecs,
# validated as Pods.
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_FIELDS = {
    "": {"apiVersion", "kind", "metadata", "spec"},
    "spec": {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"},
    "spec.leaderWorkerTemplate": {
        "leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy",
        "volumeClaimTemplates", "persistentVolumeClaimRetentionPolicy",
    },
    "spec.leaderWorkerTemplate.subGroupPolicy": {"subGroupPolicyType", "subGroupSize"},
    "spec.leaderWorkerTemplate.persistentVolumeClaimRetentionPolicy": {"whenDeleted", "whenScaled"},
    "spec.rolloutStrategy": {"type", "rollingUpdateConfiguration"},
    "spec.rolloutStrategy.rollingUpdateConfiguration": {"partition", "maxUnavailable", "maxSurge"},
    "spec.networkConfig": {"subdomainPolicy"},
}  # fmt: skip
# The fields each map must hold where it is present. The API defaults `size` to 1 (a group of
# the leader alone): here a group must say its size.
LWS_REQUIRED = {
    "": ("spec",),
    "spec": ("leaderWorkerTemplate",),
    "spec.leaderWorkerTemplate": ("workerTemplate", "size"),
    "spec.leaderWorkerTemplate.subGroupPolicy": ("subGroupSize",),
    "spec.networkConfig": ("subdomainPolicy",),
}
LWS_ENUMS = {
    "spec.startupPolicy": {"LeaderCreated", "LeaderReady"},
    "spec.leaderWorkerTemplate.restartPolicy": {
        "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None", "Default",
    },
    "spec.leaderWorkerTemplate.subGroupPolicy.subGroupPolicyType": {"LeaderWorker", "LeaderExcluded"},
    "spec.leaderWorkerTemplate.persistentVolumeClaimRetentionPolicy.whenDeleted": {"Retain", "Delete"},
    "spec.leaderWorkerTemplate.persistentVolumeClaimRetentionPolicy.whenScaled": {"Retain", "Delete"},
    "spec.rolloutStrategy.type": {"RollingUpdate"},
    "spec.networkConfig.subdomainPolicy": {"Shared", "UniquePerReplica"},
}  # fmt: skip
LWS_MINIMUMS = {
    "spec.replicas": 0,
    "spec.leaderWorkerTemplate.size": 1,
    "spec.leaderWorkerTemplate.subGroupPolicy.subGroupSize": 1,
    "spec.rolloutStrategy.rollingUpdateConfiguration.partition": 0,
}
# Its name names the headless Service too: a DNS-1035 label.
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


def _at(obj: dict[str, Any], path: str) -> Any:
    """The value at a dotted `path` of `obj` (the object itself at ""), None where absent."""
    value: Any = obj
    for key in path.split(".") if path else ():
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _check_leader_worker_set(obj: dict[str, Any], name: str) -> None:
    if obj.get("apiVersion") != LWS_API:
        raise ValueError(f"{name}: apiVersion must be {LWS_API}")
    for path, allowed in LWS_FIELDS.items():
        value = _at(obj, path)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{name}: {path} must be a map")
        unknown = sorted(set(value or {}) - allowed)
        if unknown:
            raise ValueError(f"{name}: {path or 'the object'} has unknown fields {unknown}")
    for path, required in LWS_REQUIRED.items():
        parent = _at(obj, path)
        for key in required if parent is not None else ():
            if key not in parent:
                raise ValueError(f"{name}: {path + '.' if path else ''}{key} is required")
    for path, values in LWS_ENUMS.items():
        value = _at(obj, path)
        if value is not None and value not in values:
            raise ValueError(f"{name}: {path} is {value!r}, not one of {sorted(values)}")
    for path, least in LWS_MINIMUMS.items():
        value = _at(obj, path)
        if value is not None and (type(value) is not int or value < least):
            raise ValueError(
                f"{name}: {path} must be an integer of at least {least}, not {value!r}"
            )
    rolling = _at(obj, "spec.rolloutStrategy.rollingUpdateConfiguration") or {}
    for key in ("maxUnavailable", "maxSurge"):
        if key in rolling and _int_or_percent(rolling[key]) is None:
            raise ValueError(
                f"{name}: spec.rolloutStrategy.rollingUpdateConfiguration.{key} must be an "
                f"integer of at least 0 or a percentage up to 100%, not {rolling[key]!r}"
            )
    # The webhook's defaults: one group down at a time, none surging.
    unavailable, surge = rolling.get("maxUnavailable", 1), rolling.get("maxSurge", 0)
    if not _int_or_percent(unavailable) and not _int_or_percent(surge):
        raise ValueError(f"{name}: rolling updates need maxUnavailable or maxSurge above 0")
    _check_object_meta(obj.get("metadata"), name)
    if not DNS_1035_LABEL.fullmatch(obj["metadata"].get("name", "")):
        raise ValueError(f"{name}: the name must be a DNS-1035 label (it names a Service)")
    group = obj["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        if role in group:
            _check_pod_template(group[role], f"{name}: spec.leaderWorkerTemplate.{role}")
    for index, claim in enumerate(group.get("volumeClaimTemplates") or []):
        where = f"{name}: spec.leaderWorkerTemplate.volumeClaimTemplates[{index}]"
        _validate_as({"apiVersion": "v1", "kind": "PersistentVolumeClaim", **claim}, where)


def _int_or_percent(value: Any) -> int | None:
    """An IntOrString of a rolling update, as a count or a percentage; None where invalid."""
    if type(value) is int:
        return value if value >= 0 else None
    if isinstance(value, str) and re.fullmatch(r"[0-9]+%", value) and int(value[:-1]) <= 100:
        return int(value[:-1])
    return None


def _check_object_meta(metadata: Any, name: str) -> None:
    """An ObjectMeta, validated as a ConfigMap's (whose other fields are all optional)."""
    if not isinstance(metadata, dict) or not metadata.get("name"):
        raise ValueError(f"{name}: metadata.name is required")
    _validate_as({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata}, name)


def _check_pod_template(template: Any, where: str) -> None:
    """A PodTemplateSpec, validated strictly as the Pod it becomes."""
    if not isinstance(template, dict) or set(template) - {"metadata", "spec"}:
        raise ValueError(f"{where}: a pod template holds only metadata and spec")
    if not isinstance(template.get("spec"), dict):
        raise ValueError(f"{where}: spec is required")
    metadata = {"name": "template", **(template.get("metadata") or {})}
    _validate_as(
        {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}, where
    )


def _validate_as(obj: dict[str, Any], where: str) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise ValueError(f"{where}: {exc.message} at {list(exc.path)}") from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", dest="show", choices=OVERLAYS, help="print one overlay")
    args = parser.parse_args()
    if args.show:
        print(yaml.safe_dump_all(render(DEPLOY / "overlays" / args.show), sort_keys=False))
        return 0
    for overlay in OVERLAYS:
        objects = render(DEPLOY / "overlays" / overlay)
        try:
            validate(objects)
        except ValueError as exc:
            print(f"deploy/kubernetes/overlays/{overlay}: {exc}", file=sys.stderr)
            return 1
        kinds = ", ".join(sorted(o["kind"] for o in objects))
        print(f"overlays/{overlay}: {len(objects)} objects valid for Kubernetes "
              f"{KUBERNETES_VERSION} ({kinds})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
