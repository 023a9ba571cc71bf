"""The documents name the tests that prove their claims: every named test must exist.

RELIABILITY.md, BENCHMARKS.md, README.md and docs/*.md cite tests as ``tests/x.py`` or
``tests/x.py::test_name`` (and ``::other`` / ``...::other`` for another test of the same
file). A renamed or deleted test would leave a claim without its proof.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers.sources import parse

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "RELIABILITY.md", ROOT / "BENCHMARKS.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITATION = re.compile(r"(?<![\w/.])(tests/[\w/]+\.py)((?:::\w+)?)|`(?:\.\.\.)?(::\w+)`")
"""``tests/x.py``, ``tests/x.py::test`` (in backticks or not), and a bare ``::test`` in backticks."""
NOT_IN_MAKE_TEST = re.compile(r"slow|test-all")
"""What a line citing a test that plain ``make test`` skips (``-m "not slow"``) must say."""


def citations(text: str) -> list[tuple[str, str]]:
    """(file, test) pairs in reading order; a bare ``::name`` belongs to the last file named."""
    out, last = [], None
    for m in CITATION.finditer(text):
        path, test, bare = m.group(1), m.group(2), m.group(3)
        if path:
            last = path
            out.append((path, test.lstrip(":")))
        elif bare and last:
            out.append((last, bare.lstrip(":")))
    return out


def test_citations_are_read_as_file_and_test():
    text = ("see `tests/a.py::test_one`, `::test_two` and `...::test_three`; "
            "then `tests/b/c.py` and `::test_four`")
    assert citations(text) == [("tests/a.py", "test_one"), ("tests/a.py", "test_two"),
                               ("tests/a.py", "test_three"), ("tests/b/c.py", ""), ("tests/b/c.py", "test_four")]


def _tests(path: Path) -> tuple[bool, dict[str, bool]]:
    """Whether the module is marked slow, and its test functions (at module level or in a
    ``Test*`` class) -> marked slow. Helpers and fixtures are not tests."""
    tree = parse(path.read_text())
    module_slow = any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
                      and "mark.slow" in ast.unparse(n.value) for n in tree.body)
    nodes = [*tree.body, *(m for c in tree.body if isinstance(c, ast.ClassDef) and c.name.startswith("Test") for m in c.body)]
    return module_slow, {n.name: module_slow or any("mark.slow" in ast.unparse(d) for d in n.decorator_list)
                         for n in nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")}


def defined_tests(path: Path) -> set[str]:
    return set(_tests(path)[1])


def test_only_test_functions_count_and_slow_ones_are_known(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text("import pytest\n\ndef helper():\n    pass\n\n@pytest.fixture\ndef thing():\n    pass\n\n"
                 "def test_quick():\n    pass\n\n@pytest.mark.slow\ndef test_long():\n    pass\n\n"
                 "class TestGroup:\n    def test_in_class(self):\n        pass\n")
    assert _tests(f) == (False, {"test_quick": False, "test_long": True, "test_in_class": False})
    f.write_text("import pytest\npytestmark = [pytest.mark.slow]\n\ndef test_quick():\n    pass\n")
    assert _tests(f) == (True, {"test_quick": True})
    assert citations("proved by tests/a.py::test_one and (tests/b.py)") == [("tests/a.py", "test_one"), ("tests/b.py", "")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cited_test_exists(doc):
    missing = []
    for path, test in citations(doc.read_text()):
        file = ROOT / path
        if not file.is_file():
            missing.append(path)
        elif test and test not in defined_tests(file):
            missing.append(f"{path}::{test}")
    assert not missing, f"{doc.name} cites tests that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_cited_test_that_make_test_skips_is_said_to_be_slow(doc):
    """A claim proved by a ``slow`` test is not checked by a plain ``make test``: the line that
    cites it says so (``slow`` or ``make test-all``)."""
    unsaid = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for path, test in citations(line):
            file = ROOT / path
            if not file.is_file():
                continue
            module_slow, tests = _tests(file)
            if (tests.get(test, False) if test else module_slow) and not NOT_IN_MAKE_TEST.search(line):
                unsaid.append(f"line {n}: {path}{'::' + test if test else ''}")
    assert not unsaid, f"{doc.name} cites slow tests without saying so (add `slow` or `make test-all` on the line): {unsaid}"
