"""The package's shape, as docs/architecture.md draws it: imports go one way only (no module
imports one above it, lazily or not), and no class or function outgrows a reading."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gradtrack"
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 60


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every gradtrack module ``path`` imports, at the top or inside a function."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("gradtrack"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if not base.startswith("gradtrack"):
                continue
            for alias in node.names:  # `from gradtrack import lifecycle` imports a module
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in MODULES else base)
    return found - {module}


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
GRAPH = {name: _imports(path) & MODULES.keys() for name, path in MODULES.items()}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[name] = 2
        return None

    for name in sorted(GRAPH):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_imports_go_one_way() -> None:
    assert _cycle() is None, " -> ".join(_cycle() or [])


# Packages and the ones above them, which they must never import. The threads, one way:
# the training thread (capture) hands steps through handoff to the worker, which hands records
# and alerts to delivery and the sinks; nothing flows back.
ABOVE = {
    "gradtrack.capture": (
        "gradtrack.worker",
        "gradtrack.alerts",
        "gradtrack.delivery",
        "gradtrack.sinks",
        "gradtrack.watcher",
        "gradtrack.api",
    ),
    "gradtrack.handoff": ("gradtrack.capture", "gradtrack.worker", "gradtrack.delivery"),
    "gradtrack.worker": ("gradtrack.capture", "gradtrack.watcher", "gradtrack.api"),
    "gradtrack.delivery": ("gradtrack.capture", "gradtrack.worker", "gradtrack.watcher"),
    "gradtrack.alerts": ("gradtrack.capture", "gradtrack.worker", "gradtrack.delivery"),
    "gradtrack.formats": ("gradtrack.report", "gradtrack.sinks", "gradtrack.worker"),
    "gradtrack.config": ("gradtrack.capture", "gradtrack.worker", "gradtrack.sinks"),
    "gradtrack.report": ("gradtrack.sinks", "gradtrack.worker", "gradtrack.watcher"),
    "gradtrack.sinks": ("gradtrack.worker", "gradtrack.watcher", "gradtrack.api"),
    "gradtrack.integrations": ("gradtrack.cli",),
}

# The top of the package: the entry points and what every thread shares; everything else
# lives in the package of the thread that runs it (docs/architecture.md).
TOP_LEVEL = {"__init__", "api", "cli", "errors", "lifecycle", "log", "watcher"}
PACKAGES = {
    "alerts", "capture", "config", "delivery", "formats", "handoff", "integrations", "report",
    "sinks", "worker",
}  # fmt: skip


def test_the_package_shows_its_threads() -> None:
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert (modules, packages) == (TOP_LEVEL, PACKAGES)


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_no_module_imports_one_above_it(layer: str) -> None:
    wrong = [
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        if name == layer or name.startswith(layer + ".")
        for dep in deps
        if any(dep == up or dep.startswith(up + ".") for up in ABOVE[layer])
    ]
    assert wrong == []


def test_import_gradtrack_loads_only_what_watch_needs() -> None:
    """The report, the framework callbacks, the command line, the trackers' sinks and their
    SDKs load on first use (in a fresh interpreter: this session's imports do not count); a
    watch into MLflow loads MLflow's sink and not the others."""
    import subprocess
    import sys

    lazy = ("gradtrack.report", "gradtrack.integrations", "gradtrack.cli")
    lazy += ("gradtrack.sinks.mlflow", "gradtrack.sinks.wandb", "gradtrack.sinks.tensorboard")
    sdks = ("wandb", "mlflow", "tensorboard", "tensorboardX", "matplotlib")
    probe = (
        "import sys, gradtrack; gradtrack.watch, gradtrack.unwatch; "
        f"print(sorted(m for m in sys.modules if m.startswith({lazy + sdks!r})))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert loaded.strip() == "[]"
    probe = (
        "import sys; from gradtrack.sinks import MlflowSink; "
        "print(sorted(m for m in sys.modules if m.startswith('gradtrack.sinks.')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert "gradtrack.sinks.mlflow" in loaded and "gradtrack.sinks.wandb" not in loaded


def test_only_the_command_line_imports_the_package_root() -> None:
    assert sorted(name for name, deps in GRAPH.items() if "gradtrack" in deps) == ["gradtrack.cli"]


def test_classes_and_functions_stay_small() -> None:
    too_long = []
    for name, path in sorted(MODULES.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                too_long.append(f"class {name}.{node.name}: {lines} lines")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"function {name}.{node.name}: {lines} lines")
    assert too_long == []


def test_every_temporary_directory_of_gradtrack_is_closed_by_a_with_block() -> None:
    """pyproject.toml ignores the ResourceWarning of a TemporaryDirectory left to the garbage
    collector (third-party code leaves some); gradtrack must never be the one."""
    left_open = []
    for name, path in sorted(MODULES.items()):
        tree = ast.parse(path.read_text())
        in_with = {
            id(item.context_expr)
            for node in ast.walk(tree)
            if isinstance(node, ast.With | ast.AsyncWith)
            for item in node.items
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("TemporaryDirectory"):
                if id(node) not in in_with:
                    left_open.append(f"{name}:{node.lineno}")
    assert left_open == []


def test_the_step_path_has_few_parts() -> None:
    """The stepper takes four collaborators: judge (→ plan), collect (→ pending step),
    hand-off, and the probes; on the training thread the plan alone decides whether a step
    computes its per-layer metrics (the worker's `LayerWrites` decides which records write
    them). tests/test_step_path.py bounds the files one logged step enters."""
    import inspect

    from gradtrack.capture.stepper import Stepper

    parameters = list(inspect.signature(Stepper.__init__).parameters)[1:]
    assert parameters == ["judge", "collect", "handover", "probes"]
    deciding = [
        name
        for name, path in MODULES.items()
        if name.startswith("gradtrack.capture") and ".per_layer(" in path.read_text()
    ]
    assert deciding == ["gradtrack.capture.verdict"]


def test_skip_raise_and_alerts_share_one_per_step_rules_object() -> None:
    """The per-step rules (nonfinite, spike, exploding) are built once per watch, by the alert
    engine, and the training thread's raise and skip judge with that same object: no second
    copy of their thresholds or ``enabled`` anywhere (tests/test_rules_agree.py shows both
    threads trip the same columns)."""
    import torch
    from torch import nn

    import gradtrack

    built = sorted(
        name
        for name, path in MODULES.items()
        for line in path.read_text().splitlines()
        if "PerStepRules(" in line and not line.lstrip().startswith(">>>")  # (not a doctest)
    )
    assert built == ["gradtrack.alerts.engine"]
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    alerts = {"nonfinite": {"action": "raise"}, "spike": {"action": "skip"}}
    with gradtrack.watch(model, "memory", optimizer, alerts=alerts) as watcher:
        assert isinstance(watcher, gradtrack.Watcher)
        shared = watcher.alert_engine.per_step
        judge = watcher.stepper.judge
        assert judge.raises is not None and judge.raises.per_step is shared
        assert judge.signals.skips is not None and judge.signals.skips.rules.per_step is shared


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
    ]


def test_no_sink_is_probed_for_what_it_has() -> None:
    """The sink contract is declared (`SinkBase`'s no-op defaults, `as_sink_base` for a plain
    `GradientSink`), never probed: no ``hasattr``/``getattr`` on anything named a sink."""
    probed = [
        f"{name}:{call.lineno}: {ast.unparse(call)}"
        for name, path in sorted(MODULES.items())
        for probe in ("hasattr", "getattr")
        for call in _calls(ast.parse(path.read_text()), probe)
        if call.args and "sink" in ast.unparse(call.args[0]).lower()
    ]
    assert probed == []


def test_the_worker_never_asks_which_kind_of_courier_it_has() -> None:
    """Both couriers answer `SinkCourier`'s members; the worker treats them alike."""
    asked = [
        f"{name}:{call.lineno}: {ast.unparse(call)}"
        for name, path in sorted(MODULES.items())
        if name.startswith("gradtrack.worker")
        for call in _calls(ast.parse(path.read_text()), "isinstance")
        if "courier" in ast.unparse(call).lower()
    ]
    assert asked == []


def test_files_are_replaced_in_one_place() -> None:
    """Every whole-file rewrite goes through `gradtrack.formats.write_atomic` (temp file,
    fsync, ``os.replace``): one place to get durability right."""
    replacing = sorted(
        name
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ("replace", "rename")
        and isinstance(node.value, ast.Name) and node.value.id == "os"
    )  # fmt: skip
    assert replacing == ["gradtrack.formats"]
