"""The package's import graph (module-level and function-level imports alike, read with ast) has no cycle."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "llmkernels"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(base)
                    prefix = f"{base}.{node.module}" if node.module else base
                else:
                    prefix = node.module or ""
                targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
            for t in targets:
                if t in modules and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    # a package importing its own submodules (llmkernels/__init__ re-exporting the API) is not a cycle: edges into
    # a package's __init__ from inside it are left out
    graph = import_graph()
    for mod in graph:
        graph[mod] = {t for t in graph[mod] if not mod.startswith(t + ".")}
    assert find_cycles(graph) == []
