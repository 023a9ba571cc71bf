"""The package's shape, checked: the import graph has no cycles, stages never import each
other, imports go down the floors, the root holds only entry points and shared kernels, and
the learner's and the producers' functions stay short enough to read (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers.sources import parse

PACKAGE = Path(__file__).resolve().parent.parent / "rlstream"
STAGES = ("producers", "scorers", "learner", "observe", "annotators")
"""Stages meet only through subjects and records: none imports another."""
MAX_FUNCTION_LINES = 80
LONG_MARK = "# long:"
"""A function may run longer when a comment in it says why (``# long: <the reason>``)."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every rlstream module ``name`` imports, at the top or inside a function (a lazy import
    is still a dependency), resolved to the modules that exist."""
    tree = parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t.startswith("rlstream") and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    out = {}
    for name, path in mods.items():
        deps = imports_of(name, path, known)
        # importing a package's submodule runs the package's __init__ too, but that is not an
        # edge of the code's design: drop edges to a package's own ancestors
        out[name] = {d for d in deps if not name.startswith(d + ".")}
    return out


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(g, WHITE)
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        colour[n] = GREY
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if colour.get(m) == GREY:
                return stack[stack.index(m):] + [m]
            if colour.get(m) == WHITE:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        colour[n] = BLACK
        return None

    for n in sorted(g):
        if colour[n] == WHITE:
            found = visit(n)
            if found:
                return found
    return None


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def test_the_import_graph_has_no_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_stage_imports_another():
    crossings = [f"{a} imports {b}" for a, deps in graph().items() for b in sorted(deps)
                 if stage_of(a) and stage_of(b) and stage_of(a) != stage_of(b)]
    assert not crossings, "stages meet only through subjects and records:\n" + "\n".join(crossings)


FLOORS = {
    # top-level modules and packages -> floor (docs/architecture.md); imports never go up.
    # A dotted key gives one module of a package its own floor (the longest key wins).
    "config": 1, "imports": 1, "compute": 1, "pacing": 1, "rundir": 1, "data": 1, "models": 1, "clients": 1,
    "schemas": 2, "broker": 3, "weights": 3, "envs": 3, "evaluation": 3,
    **dict.fromkeys(STAGES, 4),
    "evaluation.checkpoint": 5, "cli": 5, "run": 5, "__main__": 5, "__init__": 5,
}
ROOT_MODULES = {"__init__", "__main__", "cli", "compute", "imports", "pacing"}
"""The only modules at the root of ``rlstream/``: the entry points and the kernels every floor
shares (docs/architecture.md, "The package root" says why each is there). Anything else has
a package that says what it is."""


def floor_of(module: str) -> tuple[str, int]:
    parts = (module.partition(".")[2] or "__init__").split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in FLOORS:
            return key, FLOORS[key]
    return parts[0], 0


def test_each_floor_imports_only_lower_floors():
    g = graph()
    unknown = sorted({floor_of(m)[0] for m in g if floor_of(m)[1] == 0})
    assert not unknown, f"modules without a floor (add them to FLOORS and docs/architecture.md): {unknown}"
    upward = []
    for a, deps in g.items():
        top_a, fa = floor_of(a)
        for b in sorted(deps):
            top_b, fb = floor_of(b)
            if fb > fa:  # same floor: a stage importing a stage is test_no_stage_imports_another's
                upward.append(f"{a} (floor {fa}) imports {b} (floor {fb})")
    assert not upward, "imports go down the floors only:\n" + "\n".join(upward)


def test_the_checks_see_what_they_check():
    # the walker resolves lazy and relative imports: a cycle written inside a function counts
    g = graph()
    assert "rlstream.learner.steps" in g["rlstream.learner.loop"] or "rlstream.learner.runner" in g["rlstream.learner.loop"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert stage_of("rlstream.producers.loop") == "producers" and stage_of("rlstream.broker.io") is None


def test_the_root_holds_only_entry_points_and_shared_kernels():
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    assert loose == ROOT_MODULES, (
        f"new at the root: {sorted(loose - ROOT_MODULES)}; gone: {sorted(ROOT_MODULES - loose)}. Give a new "
        "module the package that says what it is (docs/architecture.md, the package layout)")


def test_the_layout_table_names_every_package():
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    packages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    missing = [name for name in packages if f"| `{name}/` |" not in doc]
    missing += [name for name in sorted(ROOT_MODULES - {"__init__"}) if f"| `{name}.py` |" not in doc]
    assert not missing, f"docs/architecture.md's package layout lacks: {missing}"


def test_a_module_may_sit_above_its_package():
    assert floor_of("rlstream.evaluation.rounds") == ("evaluation", 3)
    assert floor_of("rlstream.evaluation.checkpoint") == ("evaluation.checkpoint", 5)
    assert floor_of("rlstream") == ("__init__", 5) and floor_of("rlstream.nowhere.x") == ("nowhere", 0)


def long_functions(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(parse(source, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                body = "\n".join(lines[node.lineno - 1:node.end_lineno])
                if length > MAX_FUNCTION_LINES and LONG_MARK not in body:
                    out.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({length} lines)")
    return out


def test_learner_functions_are_short_or_say_why():
    too_long = long_functions(PACKAGE / "learner")
    assert not too_long, (f"over {MAX_FUNCTION_LINES} lines without a '{LONG_MARK} <reason>' comment:\n" + "\n".join(too_long))


def test_producer_functions_are_short_or_say_why():
    too_long = long_functions(PACKAGE / "producers")
    assert not too_long, (f"over {MAX_FUNCTION_LINES} lines without a '{LONG_MARK} <reason>' comment:\n" + "\n".join(too_long))


@pytest.mark.parametrize("source, flagged", [
    ("def f():\n" + "    x = 1\n" * 90, True),
    ("def f():\n    # long: one table, read top to bottom\n" + "    x = 1\n" * 90, False),
    ("def f():\n" + "    x = 1\n" * 10, False),
])
def test_the_length_check_counts_lines(tmp_path, source, flagged):
    (tmp_path / "m.py").write_text(source)
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path
    try:
        assert bool(long_functions(tmp_path)) is flagged
    finally:
        PACKAGE = saved


def mode_comparisons(root: Path, skip: tuple[str, ...] = ("config",)) -> list[str]:
    """``x.training_mode == ...`` (or ``!=``, ``in``, ``not in``) outside the config package: code
    that asks a mode's name where its params class answers a typed trait (``AlgorithmTraits``)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in skip:
            continue
        for node in ast.walk(parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Attribute) and s.attr == "training_mode" for s in sides):
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return out


def test_modes_are_asked_through_their_traits():
    found = mode_comparisons(PACKAGE)
    assert not found, "compare no training_mode string; add or use a trait of AlgorithmTraits (rlstream/config/algorithms.py):\n" + "\n".join(found)


def test_the_trait_check_sees_a_mode_comparison(tmp_path):
    (tmp_path / "m.py").write_text("def f(cfg):\n    return cfg.training_mode == 'DPO'\n")
    (tmp_path / "ok.py").write_text("def f(cfg):\n    return cfg.algorithm_params.trains_on_pairs\n")
    assert mode_comparisons(tmp_path) == [f"{tmp_path.name}/m.py:2"]
