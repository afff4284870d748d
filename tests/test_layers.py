"""The package's import graph, read from the sources (ast, nothing imported): no cycles,
and lower layers never import higher ones (shared/DESIGN.md's layout)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.core

SRC = pathlib.Path(__file__).resolve().parent.parent / "src"

# Lowest first. A module belongs to the first layer one of whose prefixes it starts with;
# a module may import its own layer or lower ones.
LAYERS = [
    ("torchjax._version", "torchjax._errors", "torchjax.errors", "torchjax._compat"),
    ("torchjax._log",),
    ("torchjax._convert", "torchjax._x64"),
    ("torchjax._primitive",),
    ("torchjax._to_jax._options", "torchjax._to_jax._context", "torchjax._to_jax._hooks"),
    ("torchjax._to_jax._call", "torchjax._to_jax._hot"),
    ("torchjax._to_jax._torch_ops",),
    ("torchjax._to_jax._fake",),
    ("torchjax._to_jax._callables",),
    ("torchjax._to_jax._torch_call",),
    ("torchjax._to_jax._xla",),
    ("torchjax._to_jax._to_jax", "torchjax._to_jax"),
    ("torchjax._module_to_jax", "torchjax._to_torch"),
    ("torchjax",),
]


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in (SRC / "torchjax").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The package modules `name` imports (at any depth of its code), each as the module
    itself: `from torchjax import errors` is torchjax.errors. Its ancestor packages are
    left out: Python runs them before the module, whatever it imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            subs = [f"{origin}.{a.name}" for a in node.names if f"{origin}.{a.name}" in modules]
            candidates = subs if len(subs) == len(node.names) else [origin, *subs]
        else:
            continue
        targets.update(c for c in candidates if c in modules)
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return targets - ancestors - {name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(name: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{name} is in no layer: add it to LAYERS (and to DESIGN.md's layout)")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    graph = _graph()
    # Known edges, so that a resolver that finds nothing cannot pass the tests below.
    assert "torchjax._to_jax._torch_call._primitive" in graph["torchjax._to_jax._torch_call._jvp"]
    assert "torchjax.errors" in graph["torchjax"]
    assert "torchjax._primitive._core" in graph["torchjax._to_jax._torch_call._primitive"]


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles in src/torchjax: {cycles}"


def test_a_cycle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_lower_layers_never_import_higher_ones():
    wrong = [
        f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
        for name, targets in sorted(_graph().items())
        for target in sorted(targets)
        if _layer(target) > _layer(name)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_primitive_imports_no_rule_and_no_callable():
    imported = _graph()["torchjax._to_jax._torch_call._primitive"]
    assert not {m for m in imported if m.startswith("torchjax._to_jax.")}, imported


def test_callables_never_import_the_primitive():
    graph = _graph()
    wrong = {
        name: sorted(t for t in targets if t.startswith("torchjax._to_jax._torch_call"))
        for name, targets in graph.items()
        if name.startswith("torchjax._to_jax._callables")
    }
    assert not any(wrong.values()), wrong


_STATE_MAKERS = {
    "threading.local",
    "threading.Lock",
    "threading.RLock",
    "weakref.WeakSet",
    "weakref.WeakKeyDictionary",
    "weakref.WeakValueDictionary",
    "contextvars.ContextVar",
}


def _ambient_state(path: pathlib.Path) -> list[str]:
    """Module-level thread-locals, locks and weak stores `path` defines: classes deriving
    from threading.local, and module-level names bound to a new one."""
    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bases = {ast.unparse(b) for b in node.bases}
            if bases & {"threading.local"}:
                found.append(f"class {node.name}")
        elif isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Call):
            maker = ast.unparse(node.value.func)
            if maker in _STATE_MAKERS:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found.extend(ast.unparse(t) for t in targets)
    return found


def test_a_calls_ambient_state_lives_in_context_alone():
    spread = {}
    for package in ("_to_jax", "_module_to_jax"):
        for path in sorted((SRC / "torchjax" / package).rglob("*.py")):
            if path.name != "_context.py":
                state = _ambient_state(path)
                if state:
                    spread[str(path.relative_to(SRC))] = state
    assert not spread, f"ambient state outside _to_jax/_context.py: {spread}"
    assert "FAKE_RUN_LOCK" in _ambient_state(SRC / "torchjax" / "_to_jax" / "_context.py")


LONG = 450  # lines: a module longer than this says why in its banner


def _banner(path: pathlib.Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines[: lines.index("from __future__ import annotations")])


def test_a_long_module_says_why_in_its_banner():
    unexplained = []
    for path in sorted((SRC / "torchjax").rglob("*.py")):
        if "_compat" in path.parts or len(path.read_text().splitlines()) <= LONG:
            continue
        if not re.search(r"Over \d+ lines", _banner(path)):
            unexplained.append(str(path.relative_to(SRC)))
    assert not unexplained, f"over {LONG} lines without a banner that says why: {unexplained}"


def test_the_xla_front_end_sits_in_its_layer():
    # The route table and the x64 policy: the table is the xla front end's, the policy
    # lies below both front ends.
    graph = _graph()
    routes = "torchjax._to_jax._xla._routes"
    assert _layer(routes) == _layer("torchjax._to_jax._xla._program")
    assert routes in graph["torchjax._to_jax._xla._program"]
    assert "torchjax._x64" in graph["torchjax._to_jax._xla._program"]
    assert "torchjax._x64" in graph["torchjax._to_jax._call._plan"]
    assert _layer("torchjax._x64") < _layer("torchjax._to_jax._call._plan")
    # The callback path's plan does not reach the xla front end, nor module_to_jax's
    # variables contract its copies.
    assert not any(m.startswith("torchjax._to_jax._xla") for m in graph["torchjax._x64"])
    assert "torchjax._module_to_jax._copies" not in graph["torchjax._module_to_jax._variables"]
    assert "torchjax._module_to_jax._copies" not in graph["torchjax._module_to_jax._xla_module"]
