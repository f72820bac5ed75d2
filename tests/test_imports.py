"""The package's modules import one another without a circle: ARCHITECTURE.md's rule that
dependencies point one way (`kernels` <- `model` <- `engine` ...), checked on the imports a module
runs when it is imported (not those inside functions or under `TYPE_CHECKING`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlxfun"


def _runtime_imports(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            yield from _runtime_imports(node.body)
            yield from _runtime_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _runtime_imports(part)


def import_graph() -> dict[str, set[str]]:
    """module -> the mlxfun modules it imports at import time."""
    modules = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in _runtime_imports(ast.parse(path.read_text()).body):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] if node.module else []
            for n in names:
                if n.startswith("mlxfun"):
                    deps.add(n if n in modules else n.rsplit(".", 1)[0])
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state, found = {}, []

    def visit(u: str, path: list[str]) -> None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                found.append(path[path.index(v):] + [v])
            elif v not in state:
                visit(v, path)
        path.pop()
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u, [])
    return found


def test_no_module_imports_itself_back_through_others():
    graph = import_graph()
    assert "mlxfun.model.linear" in graph["mlxfun.model.moe"] and "mlxfun.model.moe" in graph["mlxfun.model.llama"]
    assert cycles(graph) == []


def test_the_check_finds_a_planted_circle():
    graph = import_graph()
    graph["mlxfun.model.linear"] = graph["mlxfun.model.linear"] | {"mlxfun.model.llama"}
    found = cycles(graph)
    assert found and all({"mlxfun.model.linear", "mlxfun.model.llama"} <= set(c) for c in found), found


IMPORT_ALL = """
import importlib, pkgutil, sys
import mlx.core as mx
import mlxfun
for m in pkgutil.walk_packages(mlxfun.__path__, "mlxfun."):
    if not m.name.endswith("__main__"):
        importlib.import_module(m.name)
        if mx.get_peak_memory():
            sys.exit(f"{m.name} made an MLX array at import ({mx.get_peak_memory()} bytes)")
print(len(sys.modules))
"""


def test_importing_any_module_makes_no_mlx_array():
    """No module makes an MLX array when imported: on CUDA that opens a context in every process
    that imports mlxfun, a server's HTTP process among them (whose work then takes turns with the
    engine's on the device). Settings and tables a module keeps are NumPy or made by a function."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) > 100  # the package's modules and their dependencies were imported
    plant = "import mlx.core as mx\nX = mx.zeros((4,))\nmx.eval(X)\n"  # as a module-level table would
    planted = subprocess.run([sys.executable, "-c", plant + IMPORT_ALL], capture_output=True, text=True, timeout=120)
    assert planted.returncode != 0 and "made an MLX array at import" in planted.stderr
