"""The layout the README describes: scripts in recipes/, the library in training/, imports running one way
(recipes -> training -> data, model) and no import circle anywhere, type-only imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "data", "training", "recipes")
# What each package may import of the project (itself always).
MAY_IMPORT = {"model": set(), "data": set(), "training": {"data", "model"}, "recipes": {"training", "data", "model"}}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> set[str]:
    """The project modules a file imports, at any depth of the file (inside functions and TYPE_CHECKING too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    modules = {module_name(p) for p in sources()}
    return {m for m in found if m in modules and m != name}


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_imports_run_one_way():
    wrong = []
    for path in sources():
        own = module_name(path).split(".")[0]
        for imported in project_imports(path):
            top = imported.split(".")[0]
            if top != own and top not in MAY_IMPORT[own]:
                wrong.append(f"{module_name(path)} imports {imported}")
    assert not wrong, wrong


def test_no_import_circles():
    graph = {module_name(p): project_imports(p) for p in sources()}
    # A package's __init__ re-exporting its own modules is not a circle through them.
    for name, edges in graph.items():
        graph[name] = {e for e in edges if not (name.startswith(e + ".") and e in graph)}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            pytest.fail(" -> ".join(cycle))


SCRIPTS = sorted(p for p in (ROOT / "recipes").glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_recipes_are_scripts_that_say_how_to_run_them(path):
    text = path.read_text()
    doc = ast.get_docstring(ast.parse(text)) or ""
    assert 'if __name__ == "__main__":' in text, f"{path.name} is not a script: move it into training/"
    usage = [line for line in doc.splitlines() if line.strip().startswith(("python ", "accelerate ", "deepspeed "))]
    assert usage, f"{path.name} does not open with its usage lines"


def test_nothing_in_the_library_is_a_script():
    scripts = [p.name for p in (ROOT / "training").rglob("*.py") if 'if __name__ == "__main__":' in p.read_text()]
    assert not scripts, scripts


def private_torch_uses(path: Path) -> list[str]:
    """`torch` names with a private part (`torch._dynamo`, `torch.cuda.memory._dump_snapshot`, `from torch.x._y
    import z`) that a file imports or reads; dunders (`torch.__version__`) are public."""

    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and private(f"{node.module}.x"):
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and private(".".join([inner.id, *reversed(chain)])):
                found.append(".".join([inner.id, *reversed(chain)]))
    return found


def test_private_torch_apis_live_in_one_module():
    """STYLE.md 13: where a private torch API is unavoidable it lives in training/compat.py, which says why."""
    allowed = ROOT / "training" / "compat.py"
    found = {str(p.relative_to(ROOT)): uses for p in sources() if p != allowed and (uses := private_torch_uses(p))}
    assert not found, found


def test_the_start_up_version_floors_are_pyprojects():
    """The floors `check_versions` refuses below are the lower bounds pyproject.toml declares."""
    import tomllib

    from training.compat import FLOORS

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {d.split(">=")[0]: d.split(">=")[1] for d in declared if ">=" in d}
    assert {name: floors[name] for name in FLOORS} == FLOORS
