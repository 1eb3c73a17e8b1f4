"""The import graph of a package, read with `ast` (nothing is imported), and the boundary rules
between its concerns. tests/unit/test_repository.py runs it on megatron_specrl/ and on planted trees.

Every import counts, including those inside functions: a late import is still a dependency, and
the cycles issue #14 removed were both late imports. The two checks differ on imports for annotations
only (under `if TYPE_CHECKING:`): a cycle counts them, since two modules that name each other's types
know each other whatever Python loads (issue #56: checkpoint I/O took the learner worker this way);
the boundary rules do not, since they say what a module needs to run (the speculative core without
an engine, Ray or Megatron), and an annotation needs nothing at run time.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PKG = "megatron_specrl"

# The speculative core: the algorithm of drafting and acceptance, testable with a tabular engine.
SPECULATIVE_CORE = ("rollout.store", "rollout.acceptance", "rollout.speculative", "rollout.tree_drafting",
                    "rollout.coupled")
HEAVY = ("vllm", "sglang", "ray", "megatron")   # third-party stacks the core must not need


@dataclass(frozen=True)
class Rule:
    """Modules under one of `sources` must not import a module under one of `targets`
    (both dotted prefixes; a name inside the package is written without the package)."""
    why: str
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    allowed: tuple[str, ...] = ()       # exceptions among the targets


RULES = (
    Rule("the speculative core runs without an engine, Ray or Megatron", SPECULATIVE_CORE,
         ("engines", *(f"/{h}" for h in HEAVY)), allowed=("engines.protocol",)),
    Rule("engines never see learner code", ("engines",), ("learner",)),
    Rule("engines expose update_weights and their workers; how weights arrive is resync's", ("engines",),
         ("resync",)),
    Rule("the learner exposes weights; it never reaches an engine or the resync machinery",
         ("learner",), ("engines", "resync")),
)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _nodes(tree: ast.AST, annotations: bool):
    """Every node; without `annotations`, none under `if TYPE_CHECKING:` (imports for annotations only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if not annotations and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def imports_of(root: Path, annotations: bool = False) -> dict[str, set[str]]:
    """{module: every absolute name it imports} for each .py file under the package dir `root`;
    `annotations`: those under `if TYPE_CHECKING:` too."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        mod = module_name(root, path)
        is_pkg = path.name == "__init__.py"
        names: set[str] = set()
        for node in _nodes(ast.parse(path.read_text(), str(path)), annotations):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:   # relative: resolve against this module's package
                    base = mod.split(".")
                    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                names.add(stem)
                names.update(f"{stem}.{a.name}" for a in node.names)   # `from pkg import submodule`
        graph[mod] = names
    return graph


def internal_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges between the package's own modules (a name resolves to the longest module prefix)."""
    def resolve(name: str) -> str | None:
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in graph:
                return ".".join(parts[:k])
        return None
    out = {}
    for mod, names in graph.items():
        targets = {t for n in names if (t := resolve(n)) is not None and t != mod}
        # a package's __init__ is not a real dependency of its own submodules
        out[mod] = {t for t in targets if not mod.startswith(t + ".")}
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _qualify(prefix: str, pkg: str) -> str:
    return prefix[1:] if prefix.startswith("/") else f"{pkg}.{prefix}"   # "/vllm": a third-party name


def violations(root: Path, rules=RULES) -> list[str]:
    """'module imports name: why' for every import that crosses a rule."""
    pkg = root.name
    out = []
    for mod, names in sorted(imports_of(root).items()):
        for rule in rules:
            if not any(_under(mod, _qualify(s, pkg)) for s in rule.sources):
                continue
            bad = [n for n in sorted(names) if any(_under(n, _qualify(t, pkg)) for t in rule.targets)
                   and not any(_under(n, _qualify(a, pkg)) for a in rule.allowed)]
            # `from a.b import c` records a.b and a.b.c: report the module, not each name from it
            out.extend(f"{mod} imports {n}: {rule.why}" for n in bad
                       if not any(n != m and _under(n, m) for m in bad))
    return out


def cycles(root: Path) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted; imports for
    annotations count (the module docstring says why)."""
    g = internal_graph(imports_of(root, annotations=True))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(found)
