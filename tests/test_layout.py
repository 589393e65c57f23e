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
          "training", "tools", "api", "launch", "sweep", "cli", "__main__")


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
def _private_names(trees) -> set[str]:
    """Underscore attributes and methods brickyard's own classes define (``self._x = ...``, ``def _x``, ``_x: T``)."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    name = item.name if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
                        item.target.id if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) else ""
                    own.add(name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                own.add(node.attr)
    return {n for n in own if n.startswith("_") and not n.startswith("__")}


@pytest.mark.fast
def test_no_module_reads_another_objects_private_attributes():
    """One owner per piece of state: an object's underscore attributes are read and written by its own methods
    only (``self._x``), never as ``run._engine`` or ``trainer._parts`` from elsewhere."""
    trees = {p: ast.parse(p.read_text()) for p in SRC.rglob("*.py")}
    private = _private_names(trees.values())
    assert {"_control", "_eval_weights", "_done"} <= private  # the check sees brickyard's own private state
    reaching = []
    for path, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr in private:
                v = n.value
                if (isinstance(v, ast.Name) and v.id in ("self", "cls")) or \
                        (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super"):
                    continue
                reaching.append(f"{path.relative_to(SRC)}:{n.lineno} .{n.attr}")
    assert not reaching, "private state of another object used at " + ", ".join(reaching)


@pytest.mark.fast
def test_only_the_ways_of_training_ask_which_one_runs():
    """The trainer calls the ``Way`` interface (``training/ways``); nothing else under training/ compares
    ``dist.mode``, ``dist.strategy`` or ``boost.dim_reduce.enabled`` to choose what to do."""
    asking = []
    for path in (SRC / "training").rglob("*.py"):
        if path.parent.name == "ways":
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Compare) and isinstance(n.left, ast.Attribute) and n.left.attr in ("mode", "strategy"):
                asking.append(f"{path.relative_to(SRC)}:{n.lineno}")
            if isinstance(n, ast.Attribute) and n.attr == "enabled" and isinstance(n.value, ast.Attribute) and \
                    n.value.attr == "dim_reduce":
                asking.append(f"{path.relative_to(SRC)}:{n.lineno}")
    assert not asking, "a way of training chosen outside training/ways at " + ", ".join(asking)


@pytest.mark.fast
def test_no_function_longer_than_60_lines_and_no_module_longer_than_450():
    """Small parts a reader takes in at once: a function on one screen, a module of one concern."""
    long = []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > 450:
            long.append(f"{path.relative_to(SRC)}: {len(text.splitlines())} lines")
        for n in ast.walk(ast.parse(text)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60:
                long.append(f"{path.relative_to(SRC)}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines")
    assert not long, "too long: " + "; ".join(sorted(long))
