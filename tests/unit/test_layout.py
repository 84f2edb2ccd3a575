"""The house rules of docs/contributing.md that a script can check: the import graph of codespec/ and lsp/ has no
circles, nothing above codespec/forward/ imports a kernel, the server's, the LSP's and the CLI's functions stay
short, and the top level of codespec/ holds the engine's core and packages only."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = {"__init__", "__main__", "engine", "scheduler", "decode", "session", "adaptive", "sampling", "config",
        "errors", "stats", "healing"}  # the top level of codespec/: the engine's core (and the packages)
LONGEST = 80  # lines a function of codespec/server/, codespec/cli/ or lsp/ may take


def modules() -> dict[str, Path]:
    found = {}
    for package in ("codespec", "lsp"):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of codespec/ and lsp/ that `name` imports, anywhere in it (a function's own imports too): a
    name imported from a package counts as its module when it is one, else as the package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {module for module in found if module in known and module != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_circles():
    assert circles(graph()) == []


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_above_the_forward_imports_a_kernel():
    above = {name: targets for name, targets in graph().items() if not name.startswith("codespec.forward")}
    assert {name: sorted(t for t in targets if t.startswith("codespec.forward.kernels"))
            for name, targets in above.items() if any(t.startswith("codespec.forward.kernels") for t in targets)} == {}


def test_the_forward_imports_nothing_above_it_but_the_settings_and_errors():
    up = {name: sorted(t for t in targets if not t.startswith("codespec.forward"))
          for name, targets in graph().items() if name.startswith("codespec.forward")}
    assert {name: targets for name, targets in up.items() if set(targets) - {"codespec.config", "codespec.errors"}} == {}


def test_the_servers_the_lsps_and_the_clis_functions_are_short():
    long = []
    for folder in ("codespec/server", "codespec/cli", "lsp"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > LONGEST:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert long == []


def test_the_top_level_of_the_package_is_the_engines_core_and_packages():
    top = {path.stem for path in (ROOT / "codespec").glob("*.py")}
    assert top <= CORE, top - CORE
