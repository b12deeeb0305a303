"""The package's folders are its layers (docs/design.md): imports go one way, read from the code
with `ast` (every import, inside functions and under TYPE_CHECKING too).

errors -> config -> {platform, optim, model} -> plan -> storage -> {runtime, checkpoint} -> engine
-> {cli, integrations, progress}: a module imports only from lower layers or its own folder, parts
on one level do not import each other, and nothing imports in a circle."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "offload"

LAYERS = {
    "_adam_ext": 0,
    "_aio_ext": 0,
    "errors": 0,
    "config": 1,
    "platform": 2,
    "optim": 2,
    "model": 2,
    "plan": 3,
    "storage": 4,
    "runtime": 5,
    "checkpoint": 5,
    "engine": 6,
    "cli": 7,
    "integrations": 7,
    "progress": 7,
}
# plain decision logic: no torch
TORCH_FREE = ("offload.plan.budgets", "offload.plan.optimizer_plan", "offload.plan.pipeline_model")
# the swap store's inside, named only in storage/
STORAGE_PRIVATE = ("SwapStore", "SwapHandle", "slots", "require_swap")
ENGINE_MAX_LINES = 450
ENGINE_MAX_IMPORTS = 8
FUNCTION_MAX_LINES = 80
MODULE_MAX_LINES = 800


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}
# the C++ extensions (csrc/), leaves
EXTENSIONS = {"offload._adam_ext", "offload._aio_ext"}
KNOWN = set(MODULES) | EXTENSIONS


def imported(name: str) -> set[str]:
    """The offload modules `name` imports, wherever the import statement stands."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in KNOWN else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in KNOWN and target.startswith("offload."):
                target = target.rpartition(".")[0]
            if target.startswith("offload") and target != name:
                found.add(target)
    return found


GRAPH = {name: imported(name) for name in MODULES}


def part(name: str) -> str | None:
    """The layer part a module belongs to (`offload` itself, the lazy face, belongs to none)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def test_no_import_circle():
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        seen[name] = 1
        stack.append(name)
        for target in sorted(GRAPH.get(name, ())):
            if seen.get(target) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(target) :] + [target]))
            if target not in seen:
                visit(target)
        stack.pop()
        seen[name] = 2

    for name in sorted(MODULES):
        if name not in seen:
            visit(name)


def test_every_module_has_a_layer():
    assert sorted({part(n) for n in MODULES if part(n) is not None} - set(LAYERS)) == []


def test_imports_go_down_the_layers():
    wrong = []
    for name, targets in sorted(GRAPH.items()):
        source = part(name)
        if source is None:
            continue
        for target in sorted(targets):
            goal = part(target)
            if goal is None or goal == source:
                continue
            if LAYERS[goal] >= LAYERS[source]:
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def test_decision_logic_imports_no_torch():
    for name in TORCH_FREE:
        assert name in MODULES, name
        modules = {
            alias.name.split(".")[0]
            for node in ast.walk(TREES[name])
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
        }
        assert "torch" not in modules, name
        assert all(part(t) in ("errors", "config", "plan") for t in GRAPH[name]), (name, GRAPH[name])


def test_the_swap_store_is_private_to_storage():
    named = []
    for name, tree in sorted(TREES.items()):
        if part(name) == "storage":
            continue
        for node in ast.walk(tree):
            word = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if isinstance(node, ast.alias):
                word = node.name
            if word == "slots" and not isinstance(node, ast.Attribute):
                continue  # a plan's own count of slots; the store's are reached as `.slots`
            if word in STORAGE_PRIVATE:
                named.append(f"{name}:{getattr(node, 'lineno', '?')} {word}")
    assert named == []


def test_the_engine_is_thin():
    lines = MODULES["offload.engine"].read_text().count("\n")
    assert lines <= ENGINE_MAX_LINES, lines
    assert len(GRAPH["offload.engine"]) <= ENGINE_MAX_IMPORTS, sorted(GRAPH["offload.engine"])


def test_functions_fit_on_a_screen():
    long = []
    for name, tree in sorted(TREES.items()):
        if name != "offload.engine" and part(name) != "runtime":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_MAX_LINES:
                    long.append(f"{name}.{node.name}: {length} lines")
    assert long == []


def test_modules_fit_in_one_sitting():
    long = [f"{name}: {path.read_text().count(chr(10))} lines" for name, path in MODULES.items()]
    assert [entry for entry in long if int(entry.rsplit(": ", 1)[1].split()[0]) > MODULE_MAX_LINES] == []


ENGINE_PUBLIC = [
    "backward",
    "close",
    "config",
    "consolidated_state_dict",
    "device",
    "global_steps",
    "last_grad_norm",
    "load_checkpoint",
    "memory_report",
    "micro_steps",
    "model",
    "optimizer",
    "params_on_device",
    "save_checkpoint",
    "save_pretrained",
    "skipped_steps",
    "step",
]


@pytest.mark.parametrize("name", ENGINE_PUBLIC)
def test_the_engine_keeps_its_public_names(name):
    from offload.engine import Engine

    assert name in dir(Engine) or name in Engine.__init__.__code__.co_names, name


def test_the_package_faces():
    import offload
    import offload.checkpoint
    import offload.config

    for name in ("initialize", "Engine", "Config", "load_config", "CPUAdamW", "param_groups_no_decay"):
        assert getattr(offload, name) is not None, name
    for name in ("save", "load", "export", "CheckpointError", "CheckpointCorruptError", "CheckpointReader", "LATEST"):
        assert getattr(offload.checkpoint, name) is not None, name
    assert offload.config.Config is offload.Config
    from offload.integrations.hf import OffloadTrainer  # noqa: F401
