"""The package's shape: no import cycles between modules, imports at the top (the lazy ones say why),
and a command line that starts without torch."""
import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "brickyard"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in SRC.rglob("*.py")}


def top_level_imports(path: Path, known: set[str]) -> set[str]:
    """The brickyard modules a module imports when it is imported (not inside functions)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("brickyard")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("brickyard"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
    found = set()
    for name in out:  # importing a.b.c runs a/__init__, a/b/__init__ too
        parts = name.split(".")
        found |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & known
    return found - {module_name(path)}


@pytest.mark.fast
def test_no_module_imports_one_that_imports_it_back():
    mods = modules()
    graph = {m: top_level_imports(p, set(mods)) for m, p in mods.items()}
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}  # a package's own __init__
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.fast
def test_imports_inside_functions_say_why():
    """Imports belong at the top; one inside a function (start-up time, an optional dependency, an
    OS-only module) carries a comment at or above its first import in that function."""
    unexplained = []
    for path in SRC.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == SRC:
            continue  # `import brickyard` stays light by design (its module docstring)
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            imports = [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
            if not imports:
                continue
            first = min(n.lineno for n in imports)
            said = any("#" in lines[i - 1] for i in range(fn.lineno, first + 1))
            if not said:
                unexplained.append(f"{path.relative_to(SRC)}:{first} in {fn.name}")
    assert not unexplained, "imports inside functions without a comment saying why: " + ", ".join(unexplained)


def test_the_command_line_starts_without_torch():
    code = "import sys, brickyard.cli.main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_the_suite_runs_with_and_without_pytest_xdist():
    """``make test`` runs ``pytest -n auto``; plain ``pytest`` without the plugin must still take the conftest
    (a hook of xdist's that is not marked optional stops pytest before any test: "unknown hook")."""
    tests = Path(__file__).resolve().parent
    for plugin in (["-p", "no:xdist"], ["-n", "auto"] if importlib.util.find_spec("xdist") else []):
        r = subprocess.run([sys.executable, "-m", "pytest", *plugin, "-p", "no:cacheprovider", "--collect-only", "-q",
                            str(tests / "optim" / "test_optim.py")], capture_output=True, text=True, cwd=tests.parent)
        assert r.returncode == 0, (plugin, r.stdout[-2000:], r.stderr[-2000:])
        assert "test_optim.py::" in r.stdout


@pytest.mark.fast
def test_tests_mirror_the_package():
    tests = Path(__file__).resolve().parent
    folders = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    mirrored = {p.name for p in tests.iterdir() if p.is_dir() and list(p.glob("test_*.py"))}
    assert mirrored <= folders, f"test folders with no package folder: {sorted(mirrored - folders)}"


# the package's folders (and top-level modules) from the foundations up: each imports only what comes
# before it, at the top of a module or inside a function alike, so the layers read one way
LAYERS = ("errors", "files", "config", "optim", "data", "models", "distributed", "observe", "callbacks", "boost",
          "training", "tools", "api", "launch", "cli", "__main__")


def _layer_of(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


@pytest.mark.fast
def test_folders_depend_one_way():
    assert {p.stem if p.is_file() else p.name for p in SRC.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()} \
        - {"__init__"} == set(LAYERS), "a new folder or top-level module: give it its place in LAYERS"
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in SRC.rglob("*.py"):
        mod = module_name(path)
        here = _layer_of(mod)
        if here == "__init__":
            continue  # `import brickyard` itself: the lazy public names
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"brickyard.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module == "brickyard" \
                else [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for name in names:
                if name.startswith("brickyard.") and rank.get(_layer_of(name), -1) > rank[here]:
                    upward.append(f"{path.relative_to(SRC)}:{node.lineno} ({here}) imports {name}")
    assert not upward, "imports against the layers: " + "; ".join(upward)


@pytest.mark.fast
def test_callbacks_see_the_public_run_only():
    """brickyard's own behaviours use the contract a user's callback has: nothing under callbacks/,
    boost/ or observe/ reads or writes the run's private engine."""
    reaching = [f"{p.relative_to(SRC)}:{n.lineno}" for folder in ("callbacks", "boost", "observe")
                for p in (SRC / folder).rglob("*.py") for n in ast.walk(ast.parse(p.read_text()))
                if isinstance(n, ast.Attribute) and n.attr == "_engine"]
    assert not reaching, "private engine state used at " + ", ".join(reaching)
