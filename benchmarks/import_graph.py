"""The shape of src/grpo_launcher, measured (issue 39's done-when): file and class sizes, where the imports sit
(module top, inside functions, under TYPE_CHECKING), and the import graph between its packages: the edges that go
up the layers docs/ARCHITECTURE.md draws, and the cycles.

    python benchmarks/import_graph.py            # markdown, as benchmarks/results/consolidation.md records it

Read with ast, nothing imported. A node of the package graph is a subpackage of grpo_launcher (launch, train, ...), a
package-level module (plan, secrets, ...: layer 1, as checkpoint/), or `vocabulary`: spec/schema.py, spec/errors.py
and preflight/registry.py, what every layer is typed and ruled by (the layer below all others).
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PKG = "grpo_launcher"
LOOP_CLASS = ("train/driver.py", "Trainer")
MAX_FILE_LINES, MAX_LOOP_LINES = 800, 200

# docs/ARCHITECTURE.md "Imports flow one way": the lower the number, the lower the layer
LAYERS = {"launch": 5, "train": 4, "preflight": 4, "policy": 3, "rollout": 3, "envs": 3, "gym": 3,
          "algos": 2, "spec": 2, "tracking": 2, "models": 2, "checkpoint": 1, "vocabulary": 0}
PACKAGE_LEVEL = 1
VOCABULARY = {"spec.schema", "spec.errors", "preflight.registry"}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    base = SRC.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def node_of(module: str) -> str:
    short = module[len(PKG) + 1:]
    if short in VOCABULARY:
        return "vocabulary"
    return short.split(".")[0]


def layer(node: str) -> int:
    return LAYERS.get(node, PACKAGE_LEVEL)


def placed(tree: ast.Module) -> Iterator[tuple[ast.stmt, str]]:
    """Every import statement with where it sits: 'top', 'function' or 'type_checking'."""
    def walk(node: ast.AST, where: str) -> Iterator[tuple[ast.stmt, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, where
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(child, "function")
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from walk(child, "type_checking" if where == "top" else where)
            else:
                yield from walk(child, where)

    return walk(tree, "top")


def targets(path: Path, stmt: ast.stmt) -> list[str]:
    """The grpo_launcher modules one import statement names, relative imports resolved."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    if isinstance(stmt, ast.Import):
        names = [a.name for a in stmt.names]
    else:
        assert isinstance(stmt, ast.ImportFrom)
        mod = stmt.module or ""
        if stmt.level:
            mod = ".".join(package.split(".")[: len(package.split(".")) - stmt.level + 1] + ([mod] if mod else []))
        names = [f"{mod}.{a.name}" if is_module(f"{mod}.{a.name}") else mod for a in stmt.names]
    return sorted({n for n in names if n.startswith(PKG + ".")})


def files() -> list[Path]:
    return sorted((SRC / PKG).rglob("*.py"))


def sizes() -> list[str]:
    lines = {p: len(p.read_text().splitlines()) for p in files()}
    top = sorted(lines.items(), key=lambda kv: -kv[1])[:10]
    classes = []
    for p in files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, f"{p.relative_to(SRC / PKG)} {node.name}"))
    loop = next(n for n, where in classes if where == " ".join(LOOP_CLASS))
    out = [f"- src/{PKG}: {len(lines)} files, {sum(lines.values())} lines; over {MAX_FILE_LINES} lines: "
           f"{sum(n > MAX_FILE_LINES for n in lines.values())}",
           f"- the loop class ({' '.join(LOOP_CLASS)}): {loop} lines (limit {MAX_LOOP_LINES})",
           "- largest files: " + ", ".join(f"{p.relative_to(SRC / PKG)} {n}" for p, n in top),
           "- largest classes: " + ", ".join(f"{where} {n}" for n, where in sorted(classes, reverse=True)[:6])]
    return out


def imports() -> tuple[list[str], dict[tuple[str, str], Counter[str]], dict[str, set[str]]]:
    """The count of import statements by where they sit; the package edges (by where); the module graph."""
    where_count: Counter[str] = Counter()
    local_by_file: Counter[str] = Counter()
    edges: dict[tuple[str, str], Counter[str]] = {}
    graph: dict[str, set[str]] = {}
    for p in files():
        me = module_name(p)
        graph.setdefault(me, set())
        for stmt, where in placed(ast.parse(p.read_text())):
            where_count[where] += 1
            if where == "function":
                local_by_file[str(p.relative_to(SRC / PKG))] += 1
            for t in targets(p, stmt):
                if where != "type_checking":  # the module graph is what runs: annotations close no cycle
                    graph[me].add(t)
                a, b = node_of(me), node_of(t)
                if a != b:
                    edges.setdefault((a, b), Counter())[where] += 1
    total = sum(where_count.values())
    out = [f"- import statements: {total}; at module top {where_count['top']}, inside functions "
           f"{where_count['function']} ({100 * where_count['function'] / total:.0f} %), under TYPE_CHECKING "
           f"{where_count['type_checking']}",
           "- inside functions, by file: " + ", ".join(f"{f} {n}" for f, n in local_by_file.most_common()),
           plugin_imports()]
    return out, edges, graph


def plugin_imports() -> str:
    """The Hydra plugins (src/hydra_plugins: Hydra imports every one of their modules at each launch.py start)."""
    where: Counter[str] = Counter()
    for p in sorted((SRC / "hydra_plugins").rglob("*.py")):
        where.update(w for _, w in placed(ast.parse(p.read_text())))
    return (f"- src/hydra_plugins (not in the counts above): {sum(where.values())} import statements, inside "
            f"functions {where['function']}")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, set())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def graph_report(edges: dict[tuple[str, str], Counter[str]], modules: dict[str, set[str]]) -> list[str]:
    up = sorted((a, b, c) for (a, b), c in edges.items() if layer(b) > layer(a))
    mutual = sorted((a, b) for (a, b) in edges if (b, a) in edges and a < b)
    every: dict[str, set[str]] = {}
    down: dict[str, set[str]] = {}
    for a, b in edges:
        every.setdefault(a, set()).add(b)
        if layer(b) <= layer(a):
            down.setdefault(a, set()).add(b)
    short = {m: m[len(PKG) + 1:] for m in modules}

    def counts(c: Counter[str]) -> str:
        return ", ".join(f"{n} {w}" for w, n in sorted(c.items()))

    out = [f"- package edges: {len(edges)}; going up the layers: {len(up)}"]
    out += [f"  - {a} → {b} ({counts(c)})" for a, b, c in up]
    out.append(f"- packages importing each other: {len(mutual)}")
    out += [f"  - {a} ⇄ {b} ({counts(edges[a, b])} / {counts(edges[b, a])})" for a, b in mutual]
    for label, graph in (("cycles between packages", every), ("without the upward edges", down)):
        found = cycles(graph)
        out.append(f"- {label}: {len(found)}" + "".join(f"; {{{', '.join(c)}}}" for c in found))
    found = [[short[m] for m in c] for c in cycles(modules)]
    out.append(f"- cycles between modules (imports inside functions counted, TYPE_CHECKING not): {len(found)}")
    out += [f"  - {{{', '.join(c)}}}" for c in found]
    return out


def main() -> None:
    lines = ["## Sizes", *sizes()]
    counted, edges, modules = imports()
    lines += ["", "## Imports", *counted, "", "## Import graph", *graph_report(edges, modules)]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
