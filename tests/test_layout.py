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


def project_imports(path: Path, tree: ast.AST | None = None) -> set[str]:
    """The project modules a file imports (or `tree`, part of it), at any depth of the file (inside functions and
    TYPE_CHECKING too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree or ast.parse(path.read_text())):
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


# training/'s layers, lowest first: a module imports its own subpackage and lower layers, never a layer above it nor
# another subpackage of its own layer. The configuration (layer 0) is the flags, the version floors, the launcher's
# environment, the plain facts of the mesh, the strategy, the DeepSpeed JSON, the axes table, the pipeline
# schedules and the checkpoints' pickle check (which the flags' validation runs on --model_name_or_path): it imports
# no runtime. Above it the core (one process, DDP, FSDP2, ZeRO), then the axes beside it and
# the checkpoints, the launch resolved from them, the loop, what a run shows, and above everything the planners, then
# the doctor, the comparison and the measuring tools, which nothing below imports.
CONFIGURATION = {
    "training", "training.adamw", "training.muon", "training.optim_arguments", "training.arguments",
    "training.compat", "training.config", "training.faults",
    "training.flops", "training.limits", "training.paths", "training.pretrained", "training.mesh",
    "training.strategy", "training.deepspeed_config", "training.environment", "training.axes",
    "training.axes.table", "training.axes.pipeline", "training.axes.pipeline.schedules",
    "training.checkpoints.safety",
}  # fmt: skip
LAYERS = {"training.core": 1, "training.axes": 2, "training.checkpoints": 2, "training.launch": 3, "training.loop": 4,
          "training.report": 5, "training.plan": 6, "training.compare": 7, "training.doctor": 7,
          "training.measure": 7}  # fmt: skip
CORE_LAUNCH = ("training.core", "training.checkpoints", "training.launch", "training.loop", "training.report")


def layer_of(module: str) -> tuple[int, str]:
    """(layer, the subpackage that holds it) of a training module."""
    if module in CONFIGURATION:
        return 0, "configuration"
    package = ".".join(module.split(".")[:2])
    assert package in LAYERS, f"{module} is in no layer of tests/test_layout.py: give its subpackage one"
    return LAYERS[package], package


def test_training_imports_follow_its_layers():
    """The configuration imports no runtime, the core no axis, the planners nothing but the configuration (no
    runtime: no DeepSpeed, no training code), and nothing imports back up."""
    wrong = []
    for path in sources():
        name = module_name(path)
        if name.split(".")[0] != "training":
            continue
        layer, package = layer_of(name)
        for imported in project_imports(path):
            top = imported.split(".")[0]
            if top == "data" and package == "training.plan":
                wrong.append(f"{name}, a planner, imports {imported}")
            if top != "training":
                continue
            other, other_package = layer_of(imported)
            if not (other < layer or other_package == package):
                wrong.append(f"{name} (layer {layer}) imports {imported} (layer {other})")
            if package == "training.plan" and other not in (0, LAYERS["training.plan"]):
                wrong.append(f"{name}, a planner, imports {imported}")
    assert not wrong, wrong


def module_level_imports(path: Path) -> set[str]:
    """The project modules a file imports when it is imported: at its top level, not inside a function."""
    tree = ast.parse(path.read_text())
    top = ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[])
    return project_imports(path, top)


def test_a_core_launch_imports_no_axis():
    """A launch of one process, DDP, FSDP2 or ZeRO imports no axis's runtime: recipes/train.py's module-level imports,
    and theirs, reach no module of training/axes/ but the table and the schedules' facts; the core, the launch and
    the loop import an axis only inside the function that runs it, where its degree is above 1 (measured on real
    launches: recipes/measure/launch_imports.py)."""
    seen, todo = set(), ["recipes.train"]
    files = {module_name(p): p for p in sources()}
    while todo:
        name = todo.pop()
        if name in seen or name not in files:
            continue
        seen.add(name)
        todo += module_level_imports(files[name])
    axes = sorted(m for m in seen if m.startswith("training.axes") and m not in CONFIGURATION)
    assert not axes, axes
    core = [files[name] for name in files if name.startswith(CORE_LAUNCH)]
    lazily = {m for path in core for m in project_imports(path) if m.startswith("training.axes.")} - CONFIGURATION
    assert lazily, "the core launches no axis at all: the test reads nothing"


SCRIPTS = sorted(p for p in (ROOT / "recipes").rglob("*.py") if p.name != "__init__.py")


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


# ---------------------------------------------------------------------------------------------- strategy names

# Methods that read a string in parts. A strategy's facts are fields of `training.strategy.Strategy`; only that
# module spells a name or reads one back (`Strategy.name`, `Strategy.from_name`).
AFFIXES = {"startswith", "endswith", "removeprefix", "removesuffix"}
STRING_PARTS = AFFIXES | {"replace", "find", "index", "count"}
SPLITS = {"split", "rsplit", "partition", "rpartition"}  # at a name's "-" (a list of names splits at ",")
# What a strategy's name is made of: a family, then suffixes (zero3-offload-nvme, fsdp-hybrid-shard-grad-op).
NAME_PARTS = ("single", "ddp", "fsdp", "zero", "-offload", "-autotp", "-hybrid", "-shard-grad-op", "-no-shard")


def names_a_strategy(node: ast.expr) -> bool:
    """`strategy`, `strategy_name`, `res.strategy`, `strategy.name`, `record["strategy"]`: a strategy's name."""
    if isinstance(node, ast.Attribute) and node.attr == "name":
        return "strategy" in ast.unparse(node.value).lower()
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "strategy"
    last = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return "strategy" in last.lower()


def spells(node: ast.expr | None, text: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == text


def spells_a_strategy(node: ast.expr | None) -> bool:
    """A string literal (or a tuple of them) that begins with a part of a strategy's name."""
    values = node.elts if isinstance(node, ast.Tuple) else [node]
    return any(isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value.startswith(NAME_PARTS)
               for v in values)  # fmt: skip


def name_parsing(source: str) -> list[tuple[int, str]]:
    """(line, code) of every place `source` reads a strategy's name in parts or keeps a table of its spellings."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, first = node.func.attr, node.args[0] if node.args else None
            in_parts = method in STRING_PARTS or (method in SPLITS and not spells(first, ","))
            if (in_parts and names_a_strategy(node.func.value)) or (method in AFFIXES and spells_a_strategy(first)):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            if isinstance(node.left, ast.Constant) and any(names_a_strategy(c) for c in node.comparators):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Name, ast.Attribute)) and (getattr(node, "id", None) or node.attr) == "ALIASES":
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_name_checks_find_what_they_look_for():
    bad = [
        'strategy.name.startswith("zero")', '"offload" not in strategy.name', 'name.startswith(("zero3", "fsdp"))',
        'record["strategy"].startswith("zero")', 'name.removesuffix("-autotp")', 'strategy_name.split("-")',
        'self.strategy.name.startswith("fsdp")', 'ALIASES = {"zero2-offload-cpu": "zero2-offload"}',
        'pm.ALIASES.get(name, name)',
    ]  # fmt: skip
    assert [code for code in bad if not name_parsing(code)] == []
    fine = [
        'strategy.family == "fsdp"', 'p.name.startswith("checkpoint-")', 'k.startswith("FSDP_")', 'strategy.name',
        'f.startswith("--nvme_path")', '"zero3" in STRATEGIES', 'args.strategy.split(",")',
    ]  # fmt: skip
    assert [code for code in fine if name_parsing(code)] == []


def test_only_the_strategy_module_reads_strategy_names():
    """Facts are typed, not spelled: outside training/strategy.py nothing reads a strategy's name in parts
    (`startswith("zero")`, `"offload" in strategy.name`) or keeps a table of its spellings (`ALIASES`)."""
    allowed = ROOT / "training" / "strategy.py"
    found = [f"{path.relative_to(ROOT)}:{line}: {code}" for path in sources() if path != allowed
             for line, code in name_parsing(path.read_text())]  # fmt: skip
    assert not found, found


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
