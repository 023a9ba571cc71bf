"""deploy/k8s renders with `kubectl kustomize` (base and overlays), validates against the Kubernetes schemas,
holds together (references, probes, ports, KEDA stream names, the rlstream config), and
every container's command is one the rlstream CLI accepts."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from helpers.kustomize import RenderError, build, find, pod_specs

from rlstream.broker.layout import Layout
from rlstream.broker.passwords import ROLES as PASSWORD_ROLES
from rlstream.cli import build_parser
from rlstream.config import load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
NATS = ROOT / "deploy" / "nats"
KUBE_VERSION = "1.30.0"
TARGETS = {"base": K8S / "base", "gpu": K8S / "overlays" / "gpu", "spot": K8S / "overlays" / "spot",
           "scheduled": K8S / "overlays" / "scheduled", "backup": K8S / "overlays" / "backup",
           "distill": K8S / "overlays" / "distill"}
# Created outside the kustomization (cert-manager or by hand, docs/deploy.md).
EXTERNAL_SECRETS = {"nats-tls", "reward-tls", "rlstream-backup-s3", "rlstream-nats-users", "rlstream-nats-bcrypt", "rlstream-reward-token"}


def documented_secret_keys() -> dict[str, set[str]]:
    """The keys docs/deploy.md's ``kubectl create secret generic NAME`` commands create."""
    doc = (ROOT / "docs" / "deploy.md").read_text()
    keys: dict[str, set[str]] = {}
    for m in re.finditer(r"create secret generic (\S+)((?:[^\n]*\\\n)*[^\n]*)", doc):
        body = m.group(2)
        loop = re.search(r"for r in ([a-z ]+); do", body)
        got = set(loop.group(1).split()) if loop else set()
        got |= set(re.findall(r"--from-literal=(\w+)=", body)) - {"r"}
        for f in re.findall(r"--from-file=(\S+)", body):
            key, _, path = f.rpartition("=") if "=" in f else (Path(f).name, "", f)
            # a folder of python -m rlstream.broker.passwords: one key per role
            got |= set(PASSWORD_ROLES) if Path(path).name in ("users", "bcrypt") else {key}
        keys[m.group(1)] = got
    return keys
CRD_GROUPS = {"keda.sh", "kubeflow.org"}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def render(request):
    return request.param, build(TARGETS[request.param])


def _config(objs) -> dict:
    return yaml.safe_load(find(objs, "ConfigMap", "rlstream-config")["data"]["config.yaml"])


def _containers(objs):
    for where, spec in pod_specs(objs):
        for c in spec["containers"]:
            yield where, spec, c


# ---- kustomize --------------------------------------------------------------------------


def test_kustomize_is_the_real_one_and_fails_where_kubectl_apply_would(tmp_path):
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n")
    (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: b}\ndata: {x: y}\n")
    (tmp_path / "kustomization.yaml").write_text("resources: [cm.yaml]\npatches: [{path: p.yaml}]\n")
    with pytest.raises(RenderError, match="no matches"):
        build(tmp_path)
    # strategic merge by the schemas' merge keys: a container patched by name keeps its image
    (tmp_path / "d.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec:\n  selector: {matchLabels: {a: b}}\n"
        "  template:\n    metadata: {labels: {a: b}}\n    spec:\n      containers: [{name: c, image: i, env: [{name: A, value: '1'}]}]\n")
    (tmp_path / "p.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec:\n  template:\n    spec:\n"
        "      containers: [{name: c, env: [{name: B, value: '2'}]}]\n")
    (tmp_path / "kustomization.yaml").write_text("resources: [d.yaml]\npatches: [{path: p.yaml}]\n")
    (c,) = find(build(tmp_path), "Deployment", "d")["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "i" and sorted(e["name"] for e in c["env"]) == ["A", "B"]


# ---- schemas ----------------------------------------------------------------------------


def test_every_object_validates_against_the_kubernetes_schemas(render):
    name, objs = render
    checked = 0
    for obj in objs:
        group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
        if group in CRD_GROUPS:
            continue  # custom resources: see the hand checks below
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        checked += 1
    # pod templates inside custom resources are validated as PodTemplates
    for where, spec in pod_specs(objs):
        if where.startswith("PyTorchJob"):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": {"spec": spec}}, KUBE_VERSION, strict=True)
            checked += 1
    assert checked >= 15, f"{name}: only {checked} objects validated"


def test_schema_validation_catches_a_broken_manifest():
    good = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
            "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}}}
    kubernetes_validate.validate(good, KUBE_VERSION, strict=True)
    wrong_type = json.loads(json.dumps(good))
    wrong_type["spec"]["replicas"] = "three"
    misspelt = json.loads(json.dumps(good))
    misspelt["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    for bad in (wrong_type, misspelt):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


def test_scaled_objects_target_the_run_consumers(render):
    _, objs = render
    cfg = parse_config(_config(objs))
    lay = Layout(cfg.run, cfg.annotators)
    accounts = (NATS / "accounts.conf").read_text()
    scaled = [o for o in objs if o["kind"] == "ScaledObject"]
    # one per scalable stage: producers, scorers and each annotating stage the config turns on
    assert {o["metadata"]["name"] for o in scaled} == {"producers", "scorers", *cfg.annotators}
    for so in scaled:
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        spec = so["spec"]
        target = find(objs, spec["scaleTargetRef"].get("kind", "Deployment"), spec["scaleTargetRef"]["name"])
        assert target["kind"] == "Deployment"
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        (trigger,) = [t for t in spec["triggers"] if t["type"] == "nats-jetstream"]
        md = trigger["metadata"]
        for key in ("natsServerMonitoringEndpoint", "account", "stream", "consumer", "lagThreshold"):
            assert isinstance(md.get(key), str) and md[key], key
        stream, _subject = lay.consumers()[md["consumer"]]
        assert md["stream"] == stream
        assert re.search(rf"^\s*{md['account']}\s*{{", accounts, re.M), f"account {md['account']} not in accounts.conf"
        host, port = md["natsServerMonitoringEndpoint"].rsplit(":", 1)
        assert host.split(".")[0] == "nats" and port == "8222"
        if so["metadata"]["name"] == "producers":
            assert (md["stream"], md["consumer"]) == (lay.prompts_stream, "producers")


def test_pytorchjob_learner_has_what_the_operator_requires(render):
    name, objs = render
    job = find(objs, "PyTorchJob", "learner")
    assert job["apiVersion"] == "kubeflow.org/v1"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    for role, rs in specs.items():
        assert role in ("Master", "Worker")
        assert rs["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        assert isinstance(rs["replicas"], int) and rs["replicas"] >= 1
        (container,) = rs["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # the operator finds the container by this name
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/checkpoints" in mounts and "/dev/shm" in mounts
    assert int(job["spec"]["nprocPerNode"]) >= 1
    if name == "gpu":
        assert job["spec"]["nprocPerNode"] == "8" and specs["Worker"]["replicas"] == 1
        for rs in specs.values():
            assert rs["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8


# ---- the pieces hold together -----------------------------------------------------------


def test_references_resolve(render):
    _, objs = render
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    secrets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}
    for where, spec in pod_specs(objs):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in names, (where, v)
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in names, (where, v)
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets or v["secret"]["secretName"] in EXTERNAL_SECRETS, (where, v)
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes or where.startswith("StatefulSet"), (where, m)
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    made = documented_secret_keys().get(ref["name"]) or set(secrets[ref["name"]]["stringData"])
                    assert ref["key"] in made, (where, e)


def test_every_component_has_probes_on_its_metrics_port(render):
    _, objs = render
    port = parse_config(_config(objs)).metrics.prometheus_port
    for where, _spec, c in _containers(objs):
        if where.startswith(("Job/", "CronJob/", "PyTorchJob/learner/Worker")):
            continue  # run-to-completion jobs (feeder, backup), and learner ranks > 0 (rank 0 serves /metrics)
        assert "livenessProbe" in c and "readinessProbe" in c, where
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            http = c.get(probe, {}).get("httpGet")
            if http and http["port"] == "metrics":
                assert http["path"] == "/metrics" and ports["metrics"] == port, where
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                # without it /metrics binds to 127.0.0.1 and the kubelet cannot reach it
                assert env.get("RLSTREAM_METRICS_PUBLIC") == "1", where


def test_nats_configmap_is_the_deploy_nats_config():
    cm = find(build(TARGETS["base"]), "ConfigMap", "nats-config")
    for fname in ("nats-server.conf", "accounts.conf"):
        assert cm["data"][fname] == (NATS / fname).read_text(), f"deploy/k8s/base/nats.yaml is out of date with deploy/nats/{fname}"


def test_nats_statefulset_passes_every_password_the_accounts_need():
    objs = build(TARGETS["base"])
    sts = find(objs, "StatefulSet", "nats")
    assert sts["spec"]["replicas"] == 3
    env = {e["name"] for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    needed = set(re.findall(r"\$(RLSTREAM_[A-Z]+_PASSWORD)", (NATS / "accounts.conf").read_text())) | {"POD_NAME"}
    assert needed and needed <= env


def test_rlstream_config_validates_and_keeps_the_checkpoint_lifecycle(render):
    name, objs = render
    cfg = parse_config(_config(objs))
    assert cfg.nats.replicas == 3 and len(cfg.nats.url.split(",")) == 3
    assert cfg.checkpoint.keep_last >= 1 and cfg.checkpoint.max_age_days
    if name == "gpu":
        assert cfg.producer.backend == "vllm" and cfg.learner.engine == "deepspeed"
        assert cfg.learner.weights.transport == "shared_path"
        assert cfg.learner.deepspeed_config()["zero_optimization"]["stage"] == 3
        producers = find(objs, "Deployment", "producers")["spec"]["template"]["spec"]["containers"][0]
        assert producers["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert producers["image"].endswith(":0.1.0-cuda")
        # producers read the weights the learner writes to the shared path
        mounts = {m["mountPath"] for m in producers["volumeMounts"]}
        assert any(cfg.learner.weights.path.startswith(m) for m in mounts)
    else:
        assert find(objs, "Deployment", "producers")["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.1.0-cpu")


# ---- commands ----------------------------------------------------------------------------


def _rlstream_argv(c: dict) -> list[str]:
    cmd, args = c.get("command", []), c.get("args", [])
    if cmd == ["rlstream"]:
        return list(args)
    if cmd == ["torchrun"]:
        i = args.index("-m")
        assert args[i + 1] == "rlstream.cli", args
        return list(args[i + 2:])
    raise AssertionError(f"container {c['name']} does not run rlstream: {cmd} {args}")


def _expand(argv: list[str], values: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\(([A-Z_]+)\)", lambda m: values[m.group(1)], a) for a in argv]


def test_container_commands_parse_with_the_cli_and_load_the_config(render, tmp_path):
    _, objs = render
    cm_text = find(objs, "ConfigMap", "rlstream-config")["data"]["config.yaml"]
    users = set(re.findall(r"user:\s*(\w+)", (NATS / "accounts.conf").read_text()))
    seen = set()
    for where, spec, c in _containers(objs):
        if not c["image"].startswith("rlstream"):
            continue
        env_names = {e["name"] for e in c.get("env", [])}
        for var in re.findall(r"\$\(([A-Z_]+)\)", " ".join(c.get("args", []))):
            assert var in env_names, f"{where}: $({var}) is not in the container's env"
        argv = _expand(_rlstream_argv(c), {"POD_NAME": "p-0", "NATS_PASSWORD": "pw", "REWARD_TOKEN": "tok"})
        args = build_parser().parse_args(argv)
        seen.add(args.command)
        if hasattr(args, "config"):
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            volumes = {v["name"]: v for v in spec["volumes"]}
            cfg_dir = str(Path(args.config).parent)
            assert volumes[mounts[cfg_dir]]["configMap"]["name"] == "rlstream-config", where
            path = tmp_path / "config.yaml"
            path.write_text(cm_text)
            cfg = load_config(path, args.set)
            # the password comes from the env var at connect time: never on the command line
            assert cfg.nats.user in users and cfg.nats.password is None and cfg.nats.password_env == "NATS_PASSWORD", where
            assert not any("password=" in a for a in c.get("args", [])), f"{where}: a password on the command line"
            secret_key = next(e for e in c["env"] if e["name"] == "NATS_PASSWORD")["valueFrom"]["secretKeyRef"]["key"]
            assert secret_key == cfg.nats.user, f"{where}: password of {secret_key} used as user {cfg.nats.user}"
    assert {"feed", "producer", "scorer", "reward-server", "learner"} <= seen


def _dockerfile_instructions(path: Path) -> dict[str, list[str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = {}
    for line in text.splitlines():
        m = re.match(r"^\s*(ENTRYPOINT|CMD)\s+(.*)$", line)
        if m:
            raw = m.group(2).strip()
            out[m.group(1)] = json.loads(raw) if raw.startswith("[") else shlex.split(raw)
    return out


def _egress_to(objs, labels: dict) -> list[dict]:
    """The egress rules of every policy that selects pods with ``labels``."""
    return [rule for o in objs if o["kind"] == "NetworkPolicy" and "Egress" in o["spec"].get("policyTypes", [])
            and _selects(o["spec"]["podSelector"], labels) for rule in o["spec"].get("egress", [])]


def _reaches(rules: list[dict], labels: dict, port: int) -> bool:
    """Whether one of ``rules`` lets a pod reach pods with ``labels`` on ``port`` (in the namespace)."""
    for rule in rules:
        ports = rule.get("ports")
        if ports and not any(p.get("port", port) == port for p in ports):  # no port: every port
            continue
        for peer in rule.get("to", [{}]):
            if "ipBlock" in peer or "namespaceSelector" in peer:
                continue
            if _selects(peer.get("podSelector", {}), labels):
                return True
    return False


def test_egress_is_denied_by_default_and_allowed_only_where_a_component_must_go(render):
    """What runs in a pod (a reward function, tool calls) cannot send data out of the cluster:
    egress is denied by default, every allowing rule names where, and each component reaches
    only what it talks to."""
    _, objs = render
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert any(p["spec"]["podSelector"] == {} and p["spec"].get("policyTypes") == ["Egress"] and not p["spec"].get("egress")
               for p in policies), "no default-deny egress policy"
    pods = {where: labels for where, labels, _ in _pods(objs)}
    nats = pods["StatefulSet/nats"]
    for where, labels in pods.items():
        rules = _egress_to(objs, labels)
        for rule in rules:
            assert rule.get("to"), f"{where}: an egress rule without `to` lets it reach anything"
            for peer in rule["to"]:
                if "ipBlock" in peer:  # out of the cluster: only the backup pod, to S3's ports
                    assert labels.get("app.kubernetes.io/name") == "backup", f"{where}: egress to {peer}"
                    assert {p["port"] for p in rule["ports"]} <= {443, 9000}
                    assert "10.0.0.0/8" in peer["ipBlock"]["except"]
        dns = [r for r in rules if any(p.get("namespaceSelector") for p in r["to"])]
        assert all({p["port"] for p in r["ports"]} == {53} for r in dns), f"{where}: out of the namespace other than DNS"
        talks_to_nats = labels.get("app.kubernetes.io/name") not in ("reward-server", "backup")
        assert _reaches(rules, nats, 4222) == (talks_to_nats and where != "StatefulSet/nats"), where
        assert _reaches(rules, pods["Deployment/reward-server"], 8000) == (where == "Deployment/scorers"), where
    assert _reaches(_egress_to(objs, nats), nats, 6222)
    assert not _egress_to(objs, pods["Deployment/reward-server"]) or \
        all(any(p.get("namespaceSelector") for p in r["to"]) for r in _egress_to(objs, pods["Deployment/reward-server"]))


def test_the_broadcast_component_admits_learner_and_producers_to_each_other_only(tmp_path):
    """With ``components/broadcast`` the learner and the producers reach each other (the
    store's port and the collective's own, both ways) and no one else reaches either."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "base", tmp_path)],
        "components": [os.path.relpath(K8S / "components" / "broadcast", tmp_path)]}))
    objs = build(tmp_path)
    for p in (o for o in objs if o["kind"] == "NetworkPolicy"):
        kubernetes_validate.validate(p, KUBE_VERSION, strict=True)
    pods = {where: labels for where, labels, _ in _pods(objs)}
    learner, producers = pods["PyTorchJob/learner/Master"], pods["Deployment/producers"]
    assert _reaches(_egress_to(objs, producers), learner, 29600) and _reaches(_egress_to(objs, learner), producers, 40123)
    for target, peer in ((learner, "Deployment/producers"), (producers, "PyTorchJob/learner/Master")):
        peers = _allowed_from(objs, target, 29600)
        assert peers is not None and any(_selects(p.get("podSelector", {}), pods[peer]) for p in peers)
        assert not any(_selects(p.get("podSelector", {}), pods["Deployment/scorers"]) for p in peers if "podSelector" in p)
    assert not _reaches(_egress_to(objs, pods["Deployment/scorers"]), learner, 29600)
    without = build(TARGETS["base"])
    assert not _reaches(_egress_to(without, producers), learner, 29600)  # the base alone: not admitted


def test_no_pod_mounts_a_service_account_token(render):
    _, objs = render
    for where, _labels, spec in _pods(objs):
        assert spec.get("automountServiceAccountToken") is False, f"{where}: mounts a Kubernetes API token"


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_entrypoint_is_the_cli(name):
    path = ROOT / name
    text = path.read_text()
    inst = _dockerfile_instructions(path)
    assert inst["ENTRYPOINT"] == ["rlstream"]
    build_parser().parse_args(inst["CMD"])
    # torch, vLLM and DeepSpeed come from the image's lock (tests/deploy/test_locks.py checks
    # their pins), installed before the package
    lock = "cpu" if name.endswith(".cpu") else "cuda"
    flat_text = text.replace("\\\n", " ")
    assert flat_text.index(f"deploy/locks/{lock}.txt") < flat_text.index("COPY rlstream")
    if name == "Dockerfile":
        assert re.search(r"^FROM nvidia/cuda:", text, re.M)
    # every command the manifests run exists in the image: the package (its `rlstream` script,
    # from the sources copied in) and torch (`torchrun`), both installed by pip
    flat = text.replace("\\\n", " ")
    assert re.search(r"^COPY[^\n]*\bpyproject\.toml\b", flat, re.M) and re.search(r"^COPY rlstream\b", flat, re.M)
    assert re.search(r"^RUN pip install[^\n]*[\s\"']\.(\[[a-z,]*\])?[\"']?(\s|$)", flat, re.M), "the package itself is not installed"


def test_dockerignore_keeps_local_state_out():
    lines = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", "runs", ".git"} <= lines


# ---- hardening: non-root, read-only, no capabilities, pinned images, network policies -----


def _pods(objs):
    """(where, pod labels, pod spec) of every workload, from the rendered objects."""
    for o in objs:
        where = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
            yield where, o["spec"]["template"]["metadata"].get("labels", {}), o["spec"]["template"]["spec"]
        elif o["kind"] == "CronJob":
            template = o["spec"]["jobTemplate"]["spec"]["template"]
            yield where, template["metadata"].get("labels", {}), template["spec"]
        elif o["kind"] == "PyTorchJob":
            for role, rs in o["spec"]["pytorchReplicaSpecs"].items():
                yield f"{where}/{role}", rs["template"]["metadata"].get("labels", {}), rs["template"]["spec"]


def test_every_pod_runs_as_non_root_with_a_read_only_root_and_no_capabilities(render):
    _, objs = render
    seen = 0
    for where, _labels, spec in _pods(objs):
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) != 0, f"{where}: pod may run as root"
        assert pod.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, f"{where}/{c['name']}"
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), f"{where}/{c['name']}: capabilities not dropped"
            assert sc.get("readOnlyRootFilesystem") is True, f"{where}/{c['name']}: writable root filesystem"
            assert not sc.get("privileged") and sc.get("runAsUser", 1) != 0, f"{where}/{c['name']}"
            if c["image"].startswith("rlstream"):
                # caches and temporary files need somewhere writable: an emptyDir at /tmp, HOME there
                mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
                volumes = {v["name"]: v for v in spec.get("volumes", [])}
                assert "emptyDir" in volumes[mounts["/tmp"]], f"{where}/{c['name']}: no writable /tmp"
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                assert env.get("HOME") == "/tmp", f"{where}/{c['name']}"
            seen += 1
    assert seen >= 6


def test_third_party_images_are_pinned_by_digest(render):
    """Images from elsewhere are pinned by digest; rlstream's own image is built from this
    repository's Dockerfiles (pin it with `kustomize edit set image rlstream=REG/rlstream@sha256:...`
    once pushed; docs/deploy.md)."""
    _, objs = render
    for where, _labels, spec in _pods(objs):
        for c in spec["containers"] + spec.get("initContainers", []):
            if c["image"].split(":")[0].split("@")[0] == "rlstream":
                continue
            assert re.fullmatch(r"[\w./-]+(:[\w.-]+)?@sha256:[0-9a-f]{64}", c["image"]), f"{where}/{c['name']}: {c['image']} not pinned by digest"


def _selects(selector: dict, labels: dict) -> bool:
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        value = labels.get(e["key"])
        if e["operator"] == "In" and value not in e["values"]:
            return False
        if e["operator"] == "NotIn" and value in e["values"]:
            return False
        if e["operator"] == "Exists" and e["key"] not in labels:
            return False
        if e["operator"] == "DoesNotExist" and e["key"] in labels:
            return False
    return True


def _allowed_from(objs, labels: dict, port: int, port_name: str | None = None) -> list[dict] | None:
    """The peers that may reach ``port`` of pods with ``labels``; None means anyone (a rule
    with no ``from``, or no policy selecting the pods at all)."""
    policies = [o for o in objs if o["kind"] == "NetworkPolicy" and "Ingress" in o["spec"].get("policyTypes", ["Ingress"])
                and _selects(o["spec"]["podSelector"], labels)]
    if not policies:
        return None
    peers: list[dict] = []
    for pol in policies:
        for rule in pol["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p.get("port", port) in (port, port_name) for p in ports):  # no port: every port
                continue
            if not rule.get("from"):
                return None
            peers += rule["from"]
    return peers


def test_network_policies_deny_by_default_and_keep_nats_monitoring_private(render):
    _, objs = render
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert any(p["spec"]["podSelector"] == {} and p["spec"].get("policyTypes") == ["Ingress"] and not p["spec"].get("ingress")
               for p in policies), "no default-deny ingress policy"
    for p in policies:
        kubernetes_validate.validate(p, KUBE_VERSION, strict=True)
    pods = {where: labels for where, labels, _ in _pods(objs)}
    nats = pods["StatefulSet/nats"]
    # the monitoring port: only from the KEDA and Prometheus namespaces, never from pods at large
    peers = _allowed_from(objs, nats, 8222, "monitor")
    assert peers is not None, "the NATS monitoring port is open to every pod"
    for peer in peers:
        assert set(peer) == {"namespaceSelector"}, peer
        ns = peer["namespaceSelector"]
        assert _selects(ns, {"kubernetes.io/metadata.name": "keda"}) or _selects(ns, {"kubernetes.io/metadata.name": "monitoring"})
        assert not _selects(ns, {"kubernetes.io/metadata.name": "rlstream"}) and ns != {}
    # NATS clients: the rlstream components (the reward server has no business there)
    peers = _allowed_from(objs, nats, 4222, "client")
    assert peers is not None and all(set(p) == {"podSelector"} for p in peers)
    reach = lambda who, peers: any(_selects(p["podSelector"], pods[who]) for p in peers if "podSelector" in p)
    stages = [f"Deployment/{s}" for s in parse_config(_config(objs)).annotators]
    for who in ("Job/feeder", "Deployment/producers", "Deployment/scorers", "PyTorchJob/learner/Master", *stages):
        assert reach(who, peers), f"{who} cannot reach NATS"
    assert not reach("Deployment/reward-server", peers)
    # the reward server: from the scorers only
    peers = _allowed_from(objs, pods["Deployment/reward-server"], 8000, "http")
    assert peers is not None and reach("Deployment/scorers", peers) and not reach("Deployment/producers", peers)
    # the routes between NATS nodes still work
    assert reach("StatefulSet/nats", _allowed_from(objs, nats, 6222, "cluster"))


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfiles_pin_the_base_hold_dependencies_and_drop_root(name):
    text = (ROOT / name).read_text().replace("\\\n", " ")
    (base,) = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", base), f"{name}: base {base} not pinned by digest"
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{name}: runs as root"
    # every pip install is of a hashed lock, or of this source tree with nothing resolved
    installs = re.findall(r"pip install\b([^\n&]*)", text)
    assert len(installs) == 3, installs
    for args in installs:
        if " -r " in args:
            assert "--require-hashes" in args and "--no-deps" in args, args
        else:
            assert args.split()[-1] == "." and "--no-deps" in args and "--no-build-isolation" in args, args
    lock = "cpu" if name.endswith(".cpu") else "cuda"
    assert f"COPY deploy/locks/{lock}.txt /etc/rlstream-lock.txt" in text
    assert f"COPY deploy/locks/{lock}-build.txt /etc/rlstream-build-lock.txt" in text


def test_no_secret_reaches_a_command_line(render):
    """A Secret mapped to an env var stays there: no container expands it into its command or
    arguments (``$(VAR)``), which ``ps``, ``kubectl describe`` and the process table show."""
    _, objs = render
    checked = 0
    for where, _, c in _containers(objs):
        secret_vars = {e["name"] for e in c.get("env", []) if "secretKeyRef" in (e.get("valueFrom") or {})}
        argv = " ".join(c.get("command", []) + c.get("args", []))
        for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", argv):
            assert var not in secret_vars, f"{where}: the secret ${var} is expanded on the command line: {argv}"
        assert "--token " not in argv + " " and "token=" not in argv, f"{where}: a token on the command line: {argv}"
        checked += bool(secret_vars)
    assert checked >= 5


# ---- spot capacity and the scheduled scale-down ---------------------------------------------

SPOT_LABEL = "cloud.google.com/gke-spot"


def test_spot_overlay_puts_producers_and_scorers_on_spot_nodes_with_budgets_and_a_drain_inside_the_notice(tmp_path):
    objs = build(TARGETS["spot"])
    spot = {}
    for where, spec in pod_specs(objs):
        on_spot = spec.get("nodeSelector", {}).get(SPOT_LABEL) == "true"
        tolerates = any(t.get("key") == SPOT_LABEL and t.get("effect") == "NoSchedule" for t in spec.get("tolerations", []))
        assert on_spot == tolerates, where
        spot[where] = on_spot
    assert {w for w, s in spot.items() if s} == {"Deployment/producers", "Deployment/scorers"}
    # the learner and the broker stay on on-demand nodes
    assert not spot["StatefulSet/nats"] and not any(s for w, s in spot.items() if w.startswith("PyTorchJob"))
    budgets = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    for name in ("producers", "scorers"):
        dep = find(objs, "Deployment", name)
        (pdb,) = [b for b in budgets if _selects(b["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])]
        assert pdb["spec"]["maxUnavailable"] == 1 and pdb["metadata"]["namespace"] == dep["metadata"]["namespace"]
    # the producer's drain ends inside the pod's grace period (the preemption notice), with room for the exit
    dep = find(objs, "Deployment", "producers")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(_expand(_rlstream_argv(c), {"POD_NAME": "p-0"}))
    path = tmp_path / "config.yaml"
    path.write_text(find(objs, "ConfigMap", "rlstream-config")["data"]["config.yaml"])
    drain_s = load_config(path, args.set).producer.drain_timeout_s
    assert drain_s + 5 <= dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] <= 30


def _cron_field_ok(expr: str) -> bool:
    fields = expr.split()
    return len(fields) == 5 and all(re.fullmatch(r"[\d*,/-]+", f) for f in fields)


def test_scheduled_overlay_scales_to_the_floor_outside_the_hours():
    objs = build(TARGETS["scheduled"])
    base = {o["metadata"]["name"]: o for o in build(TARGETS["base"]) if o["kind"] == "ScaledObject"}
    for so in (o for o in objs if o["kind"] == "ScaledObject"):
        spec = so["spec"]
        by_type = {t["type"]: t for t in spec["triggers"]}
        assert set(by_type) == {"nats-jetstream", "cron"}
        backlog, hours = by_type["nats-jetstream"], by_type["cron"]
        # the backlog trigger is the base's, unchanged but for its name
        assert backlog["metadata"] == base[so["metadata"]["name"]]["spec"]["triggers"][0]["metadata"]
        md = hours["metadata"]
        assert _cron_field_ok(md["start"]) and _cron_field_ok(md["end"]) and md["timezone"]
        assert int(md["desiredReplicas"]) >= 2  # the formula reads "> 1" as inside the hours
        mod = spec["advanced"]["scalingModifiers"]
        assert mod["formula"] == f"{hours['name']} > 1 ? {backlog['name']} : 0"
        assert mod["target"] == backlog["metadata"]["lagThreshold"] and mod["metricType"] == "AverageValue"
        assert spec["minReplicaCount"] == 0 < spec["maxReplicaCount"]


def test_components_compose_on_the_gpu_overlay(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / "gpu", tmp_path)],
        "components": [os.path.relpath(K8S / "components" / c, tmp_path) for c in ("spot", "scale-schedule")],
    }))
    objs = build(tmp_path)
    producers = find(objs, "Deployment", "producers")["spec"]["template"]["spec"]
    assert producers["nodeSelector"][SPOT_LABEL] == "true"
    assert producers["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert all("scalingModifiers" in o["spec"]["advanced"] for o in objs if o["kind"] == "ScaledObject")
    for o in objs:
        if o["apiVersion"].split("/")[0] not in CRD_GROUPS:
            kubernetes_validate.validate(o, KUBE_VERSION, strict=True)


def test_backup_cronjob_backs_up_the_learners_run_dir_from_the_same_volume():
    objs = build(TARGETS["backup"])
    cron = find(objs, "CronJob", "backup")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid" and len(cron["spec"]["schedule"].split()) == 5
    spec = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    args = build_parser().parse_args(_rlstream_argv(c))
    assert args.command == "backup" and args.to.startswith("s3://") and args.keep >= 1
    # credentials come from a Secret through the environment, never the command line
    assert [e["secretRef"]["name"] for e in c["envFrom"]] == ["rlstream-backup-s3"]
    assert not any("AWS_" in a or "secret" in a.lower() for a in c["args"])
    # the learner's --run-dir, on the same claim, read-only here
    job = find(objs, "PyTorchJob", "learner")
    lc = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    learner_args = build_parser().parse_args(_rlstream_argv(lc))
    assert args.run_dir == learner_args.run_dir

    def claim_of(pod_spec, container, path):
        mount = max((m for m in container["volumeMounts"] if path.startswith(m["mountPath"])), key=lambda m: len(m["mountPath"]))
        vol = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
        return vol["persistentVolumeClaim"]["claimName"], mount.get("readOnly", False)

    assert claim_of(spec, c, args.run_dir) == ("rlstream-checkpoints", True)
    learner_spec = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert claim_of(learner_spec, lc, learner_args.run_dir)[0] == "rlstream-checkpoints"
    # the config the backup copies is the run's ConfigMap
    cfg_mount = next(m for m in c["volumeMounts"] if args.configs[0].startswith(m["mountPath"]))
    assert next(v for v in spec["volumes"] if v["name"] == cfg_mount["name"])["configMap"]["name"] == "rlstream-config"


def test_distill_overlay_runs_the_reference_and_teacher_stages_in_the_chain(tmp_path):
    """The annotating stages have Deployments: each runs `rlstream <stage> CONFIG` under its own
    NATS user, reads the config that turns the chain on, sees the teacher's model on the
    volume, and the base has no stage (its config has no stage section: a stage would exit 2)."""
    assert not {"reference", "teacher"} & {o["metadata"]["name"] for o in build(TARGETS["base"]) if o["kind"] == "Deployment"}
    objs = build(TARGETS["distill"])
    cfg_text = find(objs, "ConfigMap", "rlstream-config")["data"]["config.yaml"]
    cfg = parse_config(yaml.safe_load(cfg_text))
    assert cfg.training_mode == "DISTILL" and cfg.annotators == ("reference", "teacher")
    lay = Layout(cfg.run, cfg.annotators)
    assert lay.learner_input == (lay.annotated_stream("teacher"), lay.annotated("teacher"))
    (tmp_path / "config.yaml").write_text(cfg_text)
    for stage in cfg.annotators:
        dep = find(objs, "Deployment", stage)
        spec = dep["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        args = build_parser().parse_args(_expand(_rlstream_argv(c), {"POD_NAME": "p-0"}))
        assert args.command == stage and args.id == "p-0"
        stage_cfg = load_config(tmp_path / "config.yaml", args.set)
        assert stage_cfg.nats.user == stage and stage_cfg.nats.password_env == "NATS_PASSWORD"
        # the stage's model (the teacher's path, or the policy for the reference) is on a mounted volume
        model = getattr(stage_cfg, stage).model_path or stage_cfg.model_checkpoint_path
        assert any(model.startswith(m["mountPath"]) for m in c["volumeMounts"]), (stage, model)
        # KEDA scales it on its own consumer's backlog
        so = find(objs, "ScaledObject", stage)
        (trigger,) = so["spec"]["triggers"]
        assert (trigger["metadata"]["stream"], trigger["metadata"]["consumer"]) == (lay.consumers()[stage][0], stage)
