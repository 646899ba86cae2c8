"""attn_export.surgery has no import cycle: its modules, read with ast (imports inside functions
included, since a deferred import only moves a cycle to run time), import one another one way.
Imports of anything outside attn_export (transformers, diffusers, rich ...) are not edges."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "exporter" / "attn_export"


def _modules(root: Path):
    """Module name -> source file, for every .py file of the package; plus the compiled ones
    (a name without a source)."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    for path in root.rglob("*.so"):
        parts = list(path.relative_to(root.parent).parts)
        found.setdefault(".".join(parts[:-1] + [path.name.split(".")[0]]), None)
    return found


def _imports(name: str, path: Path, modules) -> dict:
    """The package's modules that ``name`` imports (anywhere in its body) -> the line of the first
    import. ``from a.b import c`` is an edge to ``a.b.c`` where that is a module, else to ``a.b``;
    importing ``a.b.c`` runs ``a.b``'s ``__init__`` too, but that is not an edge here (a package
    importing its own submodules would make every package a cycle)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    edges = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            targets = submodules + ([base] if len(submodules) < len(node.names) else [])
        for target in targets:
            if target in modules and target != name:
                edges.setdefault(target, node.lineno)
    return edges


def import_graph(root: Path = PACKAGE) -> dict:
    modules = _modules(root)
    return {name: _imports(name, path, modules) if path is not None else {} for name, path in modules.items()}


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm, without
    recursion), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _described(component, graph) -> str:
    members = set(component)
    return "\n".join(f"  {name} imports " + ", ".join(f"{target} (line {line})" for target, line in
                                                       sorted(graph[name].items()) if target in members)
                     for name in component)


def test_the_graph_sees_deferred_imports_and_finds_a_cycle(tmp_path):
    """The check itself: a cycle closed by an import inside a function is found."""
    package = tmp_path / "attn_export"
    (package / "surgery").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "surgery" / "__init__.py").write_text("")
    (package / "surgery" / "a.py").write_text("from attn_export.surgery import b\n")
    (package / "surgery" / "b.py").write_text("def f():\n    from attn_export.surgery.a import g\n")
    (package / "surgery" / "c.py").write_text("import transformers\nfrom . import a\n")
    graph = import_graph(package)
    assert graph["attn_export.surgery.c"] == {"attn_export.surgery.a": 2}
    assert cycles(graph) == [["attn_export.surgery.a", "attn_export.surgery.b"]]


def test_surgery_has_no_import_cycle():
    graph = import_graph()
    assert "attn_export.surgery.routes.sdpa" in graph and graph["attn_export.surgery.routes"]
    found = [component for component in cycles(graph) if any(m.startswith("attn_export.surgery") for m in component)]
    assert not found, "import cycles through attn_export.surgery:\n" + "\n\n".join(
        _described(component, graph) for component in found)
