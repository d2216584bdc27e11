"""The sub-packages of commpipe (rooms: adapt, train, parallel, runtime, sim, report, ...) import
each other without a cycle. Every import counts, at module level or inside a function, so a
lazy import cannot hide a cycle.

    python tests/test_import_graph.py      # prints the package-level edges and any cycle
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "commpipe"


def _room(module: str) -> str | None:
    """`commpipe.train.loop` -> `train`; top-level modules (commpipe.cli, ...) are no room."""
    parts = module.split(".")
    if parts[0] != "commpipe" or len(parts) < 2:
        return None
    return parts[1] if (ROOT / parts[1]).is_dir() else None


def _imports(path: Path, module: str) -> set[str]:
    """Every module `path` imports (absolute names; relative imports resolved)."""
    out: set[str] = set()
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


# Imports that still run against the direction of the rooms (models, schedules < parallel <
# runtime < sim < report, plan < train < adapt < cluster; elastic above parallel and plan),
# each named by its importing file; a test below fails when one goes away, so the list only
# shrinks.
REMAINING = {
    ("train/cli.py", "adapt"),        # the train verb adds --adapt-* flags, resumes a plan
}


def file_edges() -> set[tuple[str, str, str]]:
    """(importing file relative to commpipe/, its room, the other room it imports from)."""
    out = set()
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(("commpipe",) + path.relative_to(ROOT).with_suffix("").parts)
        src = _room(module)
        if src is None:
            continue
        for target in _imports(path, module):
            dst = _room(target)
            if dst is not None and dst != src:
                out.add((path.relative_to(ROOT).as_posix(), src, dst))
    return out


def room_edges(leave_out: set[tuple[str, str]] = frozenset()) -> dict[str, set[str]]:
    """room -> the other rooms it imports from (imports of `leave_out` not counted)."""
    edges: dict[str, set[str]] = {}
    for file, src, dst in file_edges():
        if (file, dst) not in leave_out:
            edges.setdefault(src, set()).add(dst)
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one room (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
                out.append(sorted(component))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def test_finds_a_planted_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}}) == []


def test_no_import_cycle_between_subpackages():
    edges = room_edges(REMAINING)
    assert "train" in edges and "models" in edges["train"]   # the walk sees imports at all
    cycles = find_cycles(edges)
    detail = "; ".join(" <-> ".join(c) for c in cycles)
    culprits = sorted(f"{f} -> {dst}" for f, src, dst in file_edges() for c in cycles
                      if src in c and dst in c and (f, dst) not in REMAINING)
    assert not cycles, (f"import cycles between commpipe sub-packages: {detail}; the imports "
                        f"inside them: {', '.join(culprits)}")


def test_named_cycles_are_gone():
    edges = room_edges()
    assert "runtime" not in edges["parallel"]   # the I/W split is commpipe.parallel.weight_grad
    assert "report" not in edges["sim"]         # timelines load from commpipe.timeline
    # the loop drives the controller through commpipe.train.hooks, never by name
    loop = _imports(ROOT / "train" / "loop.py", "commpipe.train.loop")
    assert not {m for m in loop if m.startswith(("commpipe.adapt.controller", "commpipe.adapt.drills"))}


def test_remaining_back_edges_still_exist():
    present = {(f, dst) for f, _, dst in file_edges()}
    gone = sorted(REMAINING - present)
    assert not gone, f"no longer imported, drop from REMAINING: {gone}"


# -- architecture branches: only commpipe/models/ may ask which family a spec belongs to; the
# rest asks the family (commpipe.models.family: planner_of, layer_form, sequence_parallel, ...)

def arch_names() -> set[str]:
    """Every registered family's spec.arch values ("llama", "gpt", "blip", ...)."""
    from commpipe.models.family import families

    return {a for f in families() for a in f.archs}


def arch_branches(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, code) of each comparison against a family's name (`spec.arch == "llama"`,
    `arch in ("gpt", "llama")`), of one spec's arch against another's (`p.arch == q.arch`),
    and of each call of a family test such as `is_blip(model)`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            consts = [c for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant)]
            archs = [s for s in sides if isinstance(s, ast.Attribute) and s.attr == "arch"]
            equality = all(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops)
            if any(c.value in names for c in consts) or (equality and archs):
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
                node.func, "id", "")
            if name.startswith("is_") and name[3:] in names:
                out.append((node.lineno, ast.unparse(node)))
    return sorted(out)


def test_finds_planted_arch_branches():
    names = {"llama", "gpt", "blip"}
    src = ("if spec.arch != 'llama': pass\n"
           "x = [p for p in ps if p.arch == spec.arch]\n"
           "if cfg.arch in ('gpt', 'moe'): pass\n"
           "if is_blip(model): pass\n"
           "y = TRAINING[family.arch] if family.arch in TRAINING else None\n"
           "if framework == 'llama3' or gpu.name == 'cpu': pass\n")
    assert [line for line, _ in arch_branches(src, names)] == [1, 2, 3, 4]


def test_nothing_outside_models_branches_on_the_architecture():
    names = arch_names()
    assert {"llama", "gpt", "blip"} <= names
    found = [f"{path.relative_to(ROOT).as_posix()}:{line}: {code}"
             for path in sorted(ROOT.rglob("*.py")) if path.relative_to(ROOT).parts[0] != "models"
             for line, code in arch_branches(path.read_text(), names)]
    assert not found, ("outside commpipe/models/, code branches on the model architecture; ask "
                       "the family instead (commpipe.models.family, docs/models.md):\n"
                       + "\n".join(found))


# -- replaced forwards: runtime features change a module through its class (DeferrableLinear,
# Recomputed) or a designated slot (Attention.core), never by assigning a `forward` attribute

def forward_assignments(source: str) -> list[tuple[int, str]]:
    """(line, code) of each assignment to an attribute named `forward`."""
    return sorted((node.lineno, ast.unparse(node)) for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                  for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                  if isinstance(t, ast.Attribute) and t.attr == "forward")


def test_finds_planted_forward_assignment():
    src = ("block.forward = wrap(block.forward)\n"
           "m.forward: object = f\n"
           "forward = 1\n"
           "block.core = wrap(block.core)\n")
    assert [line for line, _ in forward_assignments(src)] == [1, 2]


def test_no_module_forward_is_replaced_at_run_time():
    found = [f"{path.relative_to(ROOT).as_posix()}:{line}: {code}"
             for path in sorted(ROOT.rglob("*.py"))
             for line, code in forward_assignments(path.read_text())]
    assert not found, ("a module's forward is replaced by assignment; give the module a class "
                       "(commpipe.runtime.recompute.Recomputed, parallel.weight_grad."
                       "DeferrableLinear):\n" + "\n".join(found))


if __name__ == "__main__":
    graph = room_edges()
    print("cycles with every import:", "; ".join(" <-> ".join(c) for c in find_cycles(graph)))
    graph = room_edges(REMAINING)
    print("without", len(REMAINING), "remaining back edges (REMAINING):")
    for room in sorted(graph):
        print(f"{room:10s} -> {', '.join(sorted(graph[room]))}")
    cycles = find_cycles(graph)
    print("cycles:", "; ".join(" <-> ".join(c) for c in cycles) or "none")
