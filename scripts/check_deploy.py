"""Render every Kubernetes overlay under deploy/kubernetes and validate what it renders.

    python scripts/check_deploy.py            # part of `make lint`
    python scripts/check_deploy.py --print cuda

Rendering uses `kubectl kustomize` where kubectl is installed, else the small renderer below,
which implements the part of kustomize the overlays use: `resources` (files and directories),
`labels` (with `includeSelectors`) and `patches` given by `path` (strategic merge: maps merge,
lists of named items merge by name, other lists are replaced). Every rendered object is then
validated against the Kubernetes API schemas of `kubernetes-validate` (strict: unknown fields
are errors); the Prometheus Operator's ServiceMonitor, a custom resource those schemas lack, is
checked against the fields it must have.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "cuda", "cuda-multi-gpu")
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
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"{directory}: only `path` patches are rendered here: {patch}")
        for doc in yaml.safe_load_all((directory / patch["path"]).read_text()):
            target = _find(objects, doc)
            merged = _merge(target, doc)
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


def _merge(base: Any, patch: Any) -> Any:
    """Strategic merge, for maps and named lists."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = _merge(out[key], value) if key in out else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and _named(base) and _named(patch):
        out = copy.deepcopy(base)
        for item in patch:
            names = [existing["name"] for existing in out]
            if item["name"] in names:
                index = names.index(item["name"])
                out[index] = _merge(out[index], item)
            else:
                out.append(copy.deepcopy(item))
        return out
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
    import kubernetes_validate

    for obj in objects:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        if obj.get("kind") == "ServiceMonitor":
            _check_service_monitor(obj, name)
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise ValueError(f"{name}: {exc.message} at {list(exc.path)}") from None


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
