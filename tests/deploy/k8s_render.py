"""What ``kustomize build`` does with the features deploy/k8s uses, in Python.

There is no kustomize binary on these machines, so the tests render the base and the
overlays here: resources (files and directories, recursively), ``patches`` (strategic
merge patches identified by kind and name, or JSON 6902 operation lists with a
``target``), then ``namespace``, ``labels`` and ``images``, in kustomize's order. It fails
where kustomize fails: a missing file, a patch whose target does not exist, two objects
with the same kind, name and namespace, an unknown kustomization field.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "namespace", "labels", "resources", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding", "StorageClass", "CustomResourceDefinition"}
# Strategic merge: lists of these fields merge element by element on the key (as the
# Kubernetes schemas' patchMergeKey says); any other list is replaced.
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
    "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name",
}


class RenderError(ValueError):
    pass


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def strategic_merge(base: Any, patch: Any, field: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        out = [copy.deepcopy(item) for item in base]
        for item in patch:
            match = next((i for i, b in enumerate(out) if isinstance(b, dict) and b.get(key) == item.get(key)), None)
            if match is None:
                out.append(copy.deepcopy(item))
            else:
                out[match] = strategic_merge(out[match], item, None)
        return out
    return copy.deepcopy(patch)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"JSON patch path {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json6902(obj: dict, ops: list[dict]) -> dict:
    obj = copy.deepcopy(obj)
    for op in ops:
        parts = _pointer(op["path"])
        parent = obj
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        kind = op["op"]
        if isinstance(parent, list):
            if kind == "add":
                parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(op["value"]))
            elif kind == "replace":
                parent[int(last)] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del parent[int(last)]
            else:
                raise RenderError(f"unsupported JSON patch op {kind}")
        else:
            if kind == "add":
                parent[last] = copy.deepcopy(op["value"])
            elif kind == "replace":
                if last not in parent:
                    raise RenderError(f"JSON patch replace: {op['path']} does not exist")
                parent[last] = copy.deepcopy(op["value"])
            elif kind == "remove":
                if last not in parent:
                    raise RenderError(f"JSON patch remove: {op['path']} does not exist")
                del parent[last]
            else:
                raise RenderError(f"unsupported JSON patch op {kind}")
    return obj


def _matches(obj: dict, target: dict) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    return all((
        target.get("kind", obj["kind"]) == obj["kind"],
        target.get("name", obj["metadata"]["name"]) == obj["metadata"]["name"],
        target.get("group", group) == group,
        target.get("version", version) == version,
    ))


def _images(node: Any, images: list[dict]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for c in value:
                    image = c.get("image", "")
                    name = image.split("@")[0].rsplit(":", 1)[0] if ":" in image.split("/")[-1] else image.split("@")[0]
                    for rule in images:
                        if rule["name"] == name:
                            tag = rule.get("newTag")
                            c["image"] = rule.get("newName", name) + (f":{tag}" if tag else "")
            _images(value, images)
    elif isinstance(node, list):
        for item in node:
            _images(item, images)


def build(kdir: str | Path) -> list[dict]:
    kdir = Path(kdir)
    kfile = kdir / "kustomization.yaml"
    if not kfile.exists():
        raise RenderError(f"{kdir}: no kustomization.yaml")
    k = yaml.safe_load(kfile.read_text())
    unknown = set(k) - SUPPORTED
    if unknown:
        raise RenderError(f"{kfile}: fields this renderer does not implement: {sorted(unknown)}")
    objs: list[dict] = []
    for res in k.get("resources", []):
        path = kdir / res
        if path.is_dir():
            objs += build(path)
        elif path.exists():
            objs += load_docs(path)
        else:
            raise RenderError(f"{kfile}: resource {res} not found")
    for patch in k.get("patches", []):
        content = load_docs(kdir / patch["path"]) if "path" in patch else list(yaml.safe_load_all(patch["patch"]))
        target = patch.get("target")
        if len(content) == 1 and isinstance(content[0], list):
            if not target:
                raise RenderError(f"{kfile}: a JSON 6902 patch needs a target")
            hits = [i for i, o in enumerate(objs) if _matches(o, target)]
            if not hits:
                raise RenderError(f"{kfile}: patch target {target} matches nothing")
            for i in hits:
                objs[i] = json6902(objs[i], content[0])
            continue
        for doc in content:
            sel = target or {"kind": doc["kind"], "name": doc["metadata"]["name"]}
            hits = [i for i, o in enumerate(objs) if _matches(o, sel)]
            if not hits:
                raise RenderError(f"{kfile}: patch for {sel} matches nothing")
            for i in hits:
                merged = strategic_merge(objs[i], {key: v for key, v in doc.items() if key not in ("apiVersion", "kind")})
                objs[i] = merged
    ns = k.get("namespace")
    for obj in objs:
        meta = obj.setdefault("metadata", {})
        if ns and obj["kind"] not in CLUSTER_SCOPED:
            meta["namespace"] = ns
        for rule in k.get("labels", []):
            meta.setdefault("labels", {}).update(rule["pairs"])
            if rule.get("includeSelectors") or rule.get("includeTemplates"):
                raise RenderError("labels with includeSelectors/includeTemplates are not implemented here")
    if k.get("images"):
        _images(objs, k["images"])
    seen = set()
    for obj in objs:
        ident = (obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else "", obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if ident in seen:
            raise RenderError(f"{kfile}: duplicate object {ident}")
        seen.add(ident)
    return objs


def find(objs: list[dict], kind: str, name: str) -> dict:
    for o in objs:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            return o
    raise KeyError(f"{kind}/{name} not in the render")


def pod_specs(objs: list[dict]) -> list[tuple[str, dict]]:
    """(where, pod spec) of every workload: Deployment, StatefulSet, Job, PyTorchJob replicas."""
    out = []
    for o in objs:
        where = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
            out.append((where, o["spec"]["template"]["spec"]))
        elif o["kind"] == "PyTorchJob":
            for role, rs in o["spec"]["pytorchReplicaSpecs"].items():
                out.append((f"{where}/{role}", rs["template"]["spec"]))
    return out
