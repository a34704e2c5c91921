"""The package keeps its shape: imports run down the layers, no circle, small modules.

The layers are declared here, top first, and drawn in docs/design/layers.md (checked to
list them in the same order). Every import counts, including those inside functions and
under ``if TYPE_CHECKING:``: a module may import modules of lower layers, and siblings of
its own package as long as no circle forms. A kind of worker (engine/process, thread,
remote) imports no other kind's modules, and no module imports another's private names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "steadyload"

LAYERS = [
    "steadyload",  # the package itself: __init__ (public names) and __main__
    "steadyload.cli",
    "steadyload.integrations",
    "steadyload.loader",
    "steadyload.arguments",
    "steadyload.rebuild_watch",
    "steadyload.worker_count",
    "steadyload.iterators",
    "steadyload.options",
    "steadyload.device",
    "steadyload.resume",
    "steadyload.engine",
    "steadyload.start",
    "steadyload.memory",
    "steadyload.diagnosis",
    "steadyload.host",
    "steadyload.report",
    "steadyload.pickling",
    "steadyload.per_worker",
    "steadyload.errors",
    "steadyload._seeding",
    "steadyload._version",
]
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    best = None
    for rank, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(LAYERS[best]):
                best = rank
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS and layers.md")
    if best == 0 and module not in ("steadyload", "steadyload.__main__"):
        raise AssertionError(f"{module} sits at the package root outside any layer")
    return best


def _ours(name: str) -> bool:
    return name == "steadyload" or name.startswith("steadyload.")


def _target(node: ast.ImportFrom, here: str) -> str:
    """The absolute module a ``from ... import`` reads from, in package ``here``."""
    if not node.level:
        return node.module or ""
    base = here.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path) -> tuple[set[str], set[str]]:
    """(modules of the package that ``module`` imports, imported names that do not exist)."""
    tree = ast.parse(path.read_text(), str(path))
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found, missing = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    (found if alias.name in MODULES else missing).add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = _target(node, here)
            if not _ours(target):
                continue
            if target not in MODULES:
                missing.add(target)
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & set(MODULES)
            found |= subs
            # ``from pkg import submodule`` depends on the submodule, not on pkg's names.
            if len(subs) < len(node.names):
                found.add(target)
    found.discard(module)
    return found, missing


IMPORTS = {m: _imports(m, p) for m, p in MODULES.items()}
GRAPH = {m: found for m, (found, _) in IMPORTS.items()}


def test_every_import_of_the_package_exists() -> None:
    # mypy's ignore_missing_imports would not notice a function-level import left behind.
    missing = {m: sorted(gone) for m, (_, gone) in IMPORTS.items() if gone}
    assert not missing, missing


def test_every_module_sits_in_a_declared_layer() -> None:
    for module in MODULES:
        _layer(module)


def test_imports_only_run_down_the_layers() -> None:
    wrong = []
    for module, targets in GRAPH.items():
        for target in targets:
            if _layer(target) < _layer(module):
                wrong.append(f"{module} imports {target} (layer {LAYERS[_layer(target)]} is "
                             f"above {LAYERS[_layer(module)]})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circle() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(GRAPH.get(module, ())):
            if state.get(target) == 1:
                circle = stack[stack.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_nothing_below_the_loader_imports_it() -> None:
    loader = LAYERS.index("steadyload.loader")
    for module, targets in GRAPH.items():
        if _layer(module) > loader:
            assert "steadyload.loader" not in targets, module


def test_modules_are_small_and_say_what_they_own() -> None:
    for module, path in MODULES.items():
        text = path.read_text()
        lines = text.count("\n")
        assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES}: split it)"
        doc = ast.get_docstring(ast.parse(text))
        assert doc and doc.splitlines()[0].strip(), f"{module} has no one-line docstring"


def test_the_design_map_lists_the_layers_in_order() -> None:
    text = (ROOT / "docs" / "design" / "layers.md").read_text()
    block = re.search(r"```text\n(.*?)```", text, re.S)
    assert block, "docs/design/layers.md needs the layer map in a ```text block"
    drawn = re.findall(r"^(\S+?)/?\s", block.group(1), re.M)
    declared = [name.removeprefix("steadyload.").removeprefix("steadyload") for name in LAYERS]
    shown = [d.removesuffix(".py") for d in drawn]
    assert shown == [d or "__init__" for d in declared], shown


def test_only_the_task_table_writes_its_fields() -> None:
    # The table owns its invariants (iterators/tasks.py): the iterator and its collaborators
    # change it through its operations. A write is an assignment (plain, augmented, or to an
    # item) whose target is an attribute of something named like a table or a task.
    from steadyload.iterators.tasks import TaskEntry, TaskTable

    table = TaskTable(1)
    fields = set(vars(table)) | {f.lstrip("_") for f in vars(table)} | set(TaskEntry.__slots__)
    wrong = []
    for module, path in MODULES.items():
        if module == "steadyload.iterators.tasks":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            for target in targets:
                while isinstance(target, ast.Subscript):
                    target = target.value
                if not isinstance(target, ast.Attribute) or target.attr not in fields:
                    continue
                owner = ast.unparse(target.value).lower()
                if "table" in owner or owner.split(".")[-1] in ("task", "t", "entry"):
                    wrong.append(f"{module}:{node.lineno}: {ast.unparse(target)}")
    assert not wrong, "written outside the task table:\n" + "\n".join(wrong)


KINDS = ("steadyload.engine.process", "steadyload.engine.thread", "steadyload.engine.remote")


def _kind(module: str) -> str | None:
    return next((k for k in KINDS if module == k or module.startswith(k + ".")), None)


def test_no_kind_imports_another_kind() -> None:
    # What kinds share lives in engine/worker, engine/transport, engine/choice or the engine
    # root; a kind reaching into another's package would tie their changes together again.
    wrong = []
    for module, targets in GRAPH.items():
        kind = _kind(module)
        if kind is None:
            continue
        wrong += [f"{module} imports {t}" for t in targets if _kind(t) not in (None, kind)]
    assert not wrong, "\n".join(sorted(wrong))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _private_uses(module: str, path: Path) -> list[str]:
    """Private names of other modules that ``module`` imports or reads off a module."""
    tree = ast.parse(path.read_text(), str(path))
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    bound: dict[str, str] = {}  # local name -> the package module it stands for
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    name = alias.asname or alias.name.partition(".")[0]
                    bound[name] = alias.name if alias.asname else name
        elif isinstance(node, ast.ImportFrom):
            target = _target(node, here)
            if not _ours(target):
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                if full in MODULES:  # a module, private or not: fine
                    bound[alias.asname or alias.name] = full
                elif _private(alias.name):
                    wrong.append(f"{module} imports {alias.name} from {target}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        chain = _dotted(node.value)
        if chain is None or chain[0] not in bound:
            continue
        owner = ".".join([bound[chain[0]], *chain[1:]])
        if owner in MODULES and owner != module and f"{owner}.{node.attr}" not in MODULES:
            wrong.append(f"{module} reads {owner}.{node.attr}")
    return wrong


def test_no_module_imports_a_private_name_of_another() -> None:
    # A `_name` is its module's own: one shared must be made public where it is defined.
    # Private modules (`from . import _bench_run`) are fine; only names inside modules count.
    wrong = [w for m, p in MODULES.items() for w in _private_uses(m, p)]
    assert not wrong, "\n".join(sorted(wrong))


def test_the_package_root_is_the_public_face_and_mechanisms_are_wings() -> None:
    # A flat root hides the architecture: each mechanism is a sub-package (resume/,
    # diagnosis/, host/, engine/worker/, ...). The limits are the layout's (DESIGN.md).
    def count(folder: Path) -> int:
        return sum(1 for p in folder.glob("*.py"))

    assert count(PACKAGE) <= 14, sorted(p.name for p in PACKAGE.glob("*.py"))
    assert count(PACKAGE / "engine") <= 8, sorted(p.name for p in (PACKAGE / "engine").glob("*.py"))


def test_no_formatter_escapes() -> None:
    # The formatter's layout is the house layout: a module that only fits in 400 lines by
    # hand-packing statements is split instead (issue #35).
    wrong = [
        str(path.relative_to(ROOT))
        for path in MODULES.values()
        if "# fmt: skip" in path.read_text()
    ]
    assert not wrong, "# fmt: skip in:\n" + "\n".join(sorted(wrong))
