"""``components/require-digests``: a ValidatingAdmissionPolicy that refuses a Pod whose images
are named by tag. Its CEL rule is evaluated here with cel-python on the Pods the manifests
render (the API server evaluates the same expression with its own CEL)."""

from __future__ import annotations

import os
from pathlib import Path

import celpy
import kubernetes_validate
import pytest
import yaml
from helpers.kustomize import build, find, pod_specs

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBE_VERSION = "1.30.0"
DIGEST = "@sha256:" + "ab" * 32


def _render(tmp_path: Path, base: str = "base", digest: bool = False) -> list[dict]:
    kust = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(K8S / base, tmp_path)],
            "components": [os.path.relpath(K8S / "components" / "require-digests", tmp_path)]}
    if digest:  # what `kustomize edit set image rlstream=REG/rlstream@sha256:...` writes
        kust["images"] = [{"name": "rlstream", "newName": "registry.example/rlstream", "digest": DIGEST[1:]}]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kust))
    return build(tmp_path)


def _admits(objs: list[dict]):
    policy = find(objs, "ValidatingAdmissionPolicy", "rlstream-images-by-digest")
    env = celpy.Environment()
    programs = [env.program(env.compile(v["expression"])) for v in policy["spec"]["validations"]]

    def admits(pod_spec: dict) -> bool:
        pod = celpy.json_to_cel({"apiVersion": "v1", "kind": "Pod", "spec": pod_spec})
        return all(bool(p.evaluate({"object": pod})) for p in programs)
    return admits


@pytest.mark.parametrize("base", ["base", "overlays/gpu"])
def test_a_tag_is_refused_and_a_digest_admitted(tmp_path, base):
    objs = _render(tmp_path, base)
    for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
        kubernetes_validate.validate(find(objs, kind, "rlstream-images-by-digest"), KUBE_VERSION, strict=True)
    admits = _admits(objs)
    specs = dict(pod_specs(objs))
    refused = {where for where, spec in specs.items() if not admits(spec)}
    own = {where for where, spec in specs.items()
           if any(c["image"].split("@")[0].split(":")[0] == "rlstream" for c in spec["containers"] + spec.get("initContainers", []))}
    # rlstream's own image is named by tag in the shipped manifests; everything else by digest
    assert own and refused == own, (sorted(refused), sorted(own))
    pinned = _render(tmp_path, base, digest=True)
    assert all(admits(spec) for _, spec in pod_specs(pinned))


def test_an_init_container_by_tag_is_refused_too(tmp_path):
    admits = _admits(_render(tmp_path))
    ok = {"image": "registry.example/rlstream" + DIGEST}
    assert admits({"containers": [ok]})
    assert not admits({"containers": [ok], "initContainers": [{"image": "busybox:1.36"}]})
    assert not admits({"containers": [ok, {"image": "registry.example/rlstream:latest"}]})
    assert not admits({"containers": [{"image": "registry.example/rlstream@sha256:short"}]})


def test_the_binding_denies_in_the_namespace_the_manifests_use(tmp_path):
    objs = _render(tmp_path)
    binding = find(objs, "ValidatingAdmissionPolicyBinding", "rlstream-images-by-digest")
    assert binding["spec"]["validationActions"] == ["Deny"]
    namespaces = {o["metadata"].get("namespace") for o in objs if o["kind"] in ("Deployment", "StatefulSet")}
    assert namespaces == {binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]}
