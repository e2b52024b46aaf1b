"""The architecture docs/development.md describes is the code's: its layer table against every
import in hvdkit/ (lazy and TYPE_CHECKING ones included), no import circle, no probe of a
strategy's types outside the strategy, no backend name compared outside backends/ and bench/,
gradient hooks registered by their owners only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "hvdkit"


def modules() -> dict[str, Path]:
    """Dotted name (without 'hvdkit.'; the package itself is 'hvdkit') -> file."""
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts) or "hvdkit"] = path
    return out


MODULES = modules()


def _target(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The hvdkit modules an import statement in ``module`` reaches."""
    is_pkg = MODULES[module].name == "__init__.py"
    here = [] if module == "hvdkit" else module.split(".")
    package = here if is_pkg else here[:-1]
    names: list[str] = []
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package[:len(package) - node.level + 1]
        elif node.module and (node.module == "hvdkit" or node.module.startswith("hvdkit.")):
            base = []
            node_module = node.module.split(".")[1:]
            names = [".".join(node_module + [a.name]) for a in node.names] or [".".join(node_module)]
            return [_known(n) for n in names if _known(n)]
        else:
            return []
        stem = base + (node.module.split(".") if node.module else [])
        names = [".".join(stem + [a.name]) for a in node.names]
        return [k for k in (_known(n) or _known(".".join(stem)) for n in names) if k]
    return [k for k in (_known(".".join(a.name.split(".")[1:])) for a in node.names
                        if a.name == "hvdkit" or a.name.startswith("hvdkit.")) if k]


def _known(name: str) -> str | None:
    """``name`` or its nearest enclosing module that exists ('' is the package)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return "hvdkit"


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        graph[module] = {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                         for t in _target(module, node) if t != module}
    return graph


def layers() -> dict[str, int]:
    """docs/development.md's table: module -> layer."""
    text = (ROOT / "docs" / "development.md").read_text()
    out: dict[str, int] = {}
    for layer, cell in re.findall(r"^\| (\d+) \| (.+) \|$", text, flags=re.M):
        for module in re.findall(r"`([\w.]+)`", cell):
            assert module not in out, f"{module} is in two layers"
            out[module] = int(layer)
    return out


def test_every_module_is_in_one_layer_and_no_import_reaches_up_or_closes_a_circle():
    table, graph = layers(), import_graph()
    assert set(table) == set(MODULES), (sorted(set(MODULES) - set(table)), sorted(set(table) - set(MODULES)))
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if table[t] > table[m])
    assert upward == [], upward
    # no circle: a topological order exists
    remaining = {m: set(t) for m, t in graph.items()}
    while remaining:
        free = [m for m, t in remaining.items() if not t & set(remaining)]
        assert free, f"import circle among {sorted(remaining)}"
        for m in free:
            del remaining[m]


def test_the_graph_sees_lazy_and_type_checking_imports():
    """The check above would be empty if the parser missed imports inside functions."""
    graph = import_graph()
    assert "backends.modes" in graph["backends.base"]
    assert "backends.base" in graph["state"]          # under TYPE_CHECKING
    assert "loop" in graph["cli.train_cmd"]           # inside a function
    assert "backends.comm" in graph["backends.zero"]


STRATEGY_TYPES = {"DistributedDataParallel", "ShardedOptimizer", "FSDPModule", "DTensor", "Strategy",
                  "Replicated", "HorovodReplicated", "DDPReplicated", "ZeroStrategy", "FullyShardedStrategy"}
PROBED_ATTRS = {"skip_synchronize", "rebuild_buckets", "synchronize", "to_local", "no_sync", "module",
                "powersgd", "parallelism"}
OWNERS = {"FSDPModule": "backends/fsdp.py", "DTensor": "backends/fsdp.py"}


def _calls(path: Path) -> list[ast.Call]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]


def test_no_probe_of_a_strategys_wrapper_or_optimizer_types_outside_its_owner():
    found = []
    for path in PKG.rglob("*.py"):
        rel = str(path.relative_to(PKG))
        for call in _calls(path):
            name = getattr(call.func, "id", None)
            if name == "isinstance" and len(call.args) == 2:
                kinds = call.args[1].elts if isinstance(call.args[1], ast.Tuple) else [call.args[1]]
                for kind in kinds:
                    kind_name = getattr(kind, "id", None) or getattr(kind, "attr", None)
                    if kind_name in STRATEGY_TYPES and OWNERS.get(kind_name) != rel:
                        found.append(f"{rel}:{call.lineno} isinstance {kind_name}")
            if name in ("getattr", "hasattr") and len(call.args) >= 2 and isinstance(call.args[1], ast.Constant) \
                    and call.args[1].value in PROBED_ATTRS:
                found.append(f"{rel}:{call.lineno} {name} {call.args[1].value}")
    assert found == [], found


def test_no_backend_name_is_compared_outside_backends_and_bench():
    names = {"horovod", "ddp"}
    found = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        if rel.parts[0] in ("backends", "bench"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            for side in [node.left, *node.comparators]:
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                    found.append(f"{rel}:{node.lineno}")
    assert found == [], found


def test_gradient_hooks_are_registered_by_their_owners_only():
    """The bucket engine (Horovod's reducer, ZeRO, ZeRO-3) and DDP's replicated strategy (its comm
    hooks and the last-gradient timestamp); nothing else hooks gradients. ZeRO-3 hooks a unit's
    outputs, not a gradient: backward reaching them gathers the unit's parameters again."""
    hooks = {"register_post_accumulate_grad_hook", "register_hook", "register_comm_hook",
             "register_full_backward_hook", "register_full_backward_pre_hook"}
    where = sorted({str(path.relative_to(PKG)) for path in PKG.rglob("*.py") for call in _calls(path)
                    if getattr(call.func, "attr", None) in hooks})
    assert where == ["backends/buckets.py", "backends/ddp.py", "backends/zero3.py"], where
    zero3 = {getattr(call.func, "attr", None) for call in _calls(PKG / "backends" / "zero3.py")} & hooks
    assert zero3 == {"register_hook"}, zero3


def test_every_shard_mode_has_one_strategy():
    from hvdkit.backends.modes import SHARDED
    from hvdkit.config import SHARD_MODES

    assert {"none", *SHARDED} == set(SHARD_MODES)
