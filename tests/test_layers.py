"""omni's import contract: floors from the bottom, nothing imports upward, imports inside functions included.

The graph is read from the source (ast), so an import hidden in a function body or a lazy branch counts
like a top-level one; imports under ``if TYPE_CHECKING:`` are not runtime edges and are left out. A module
on floor N may import modules on floors <= N (its own floor included), and the whole graph has no cycle.
A new module must be given a floor here: an unplaced module fails the test, so the map stays complete.
"""

from __future__ import annotations

import ast
from pathlib import Path

OMNI = Path(__file__).resolve().parents[1] / "omni"

# Floors, bottom first. An entry names a module or a package prefix ("omni.data.builders_" matches
# every omni.data.builders_* module; "omni.rl." every module of the package omni.rl).
FLOORS: list[tuple[str, list[str]]] = [
    ("leaf helpers", ["omni", "omni.files", "omni.deps", "omni.lock", "omni.console", "omni.asr_text",
                      "omni.export_kinds", "omni.data.rdata", "omni.data.speech", "omni.data.memory",
                      "omni.data.ars", "omni.scripts", "omni.data.errors", "omni.image_bytes"]),
    ("core", ["omni.segment", "omni.trunk", "omni.attention_patterns", "omni.banded_attention", "omni.packing",
              "omni.interfaces",
              "omni.cuda_graphs", "omni.activation",
              "omni.data.shards", "omni.data.fields", "omni.data.tar_index", "omni.data.plan", "omni.data.reader",
              "omni.data", "omni.data.corpora", "omni.data.policies", "omni.data.remote"]),
    ("tokenizers, heads, decoding, export", ["omni.tokenizers", "omni.tokenizers.", "omni.heads", "omni.decoding",
                                             "omni.model", "omni.export", "omni.plots", "omni.data.clips", "omni.config",
                                             "omni.mixture", "omni.speculative"]),
    ("models and model-free algorithms", ["omni.vision", "omni.speech", "omni.rl", "omni.rl.", "omni.prefix_lm",
                                          "omni.timestamps", "omni.introspect", "omni.generate",
                                          "omni.alignment_plot", "omni.transcript_formats", "omni.mask_ctc"]),
    ("tasks", ["omni.tasks", "omni.tasks.", "omni.multitask"]),
    ("training", ["omni.steps", "omni.optimizers", "omni.evaluation", "omni.progress", "omni.interrupts",
                  "omni.checkpointing", "omni.train", "omni.config_schema",
                  "omni.init", "omni.interop", "omni.interop.", "omni.data.builders_", "omni.data.builders"]),
    ("pipelines", ["omni.pipelines", "omni.pipelines.", "omni.recipe_runtime"]),
    ("command line", ["omni.cli", "omni.data.cli"]),
]


def module_files() -> dict[str, Path]:
    mods = {}
    for path in OMNI.rglob("*.py"):
        name = ".".join(path.relative_to(OMNI.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """{module: omni modules it imports anywhere in its body}, resolved to the longest known module name."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                for n in ast.walk(node)}
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for name in names:
                while name and name not in mods:
                    name = name.rsplit(".", 1)[0] if "." in name else ""
                # a package's own submodules importing it (for its re-exports) is not an upward edge
                if name and name != mod and not mod.startswith(name + "."):
                    graph[mod].add(name)
    return graph


def floor_of(mod: str) -> int | None:
    best: tuple[int, int] | None = None  # (length of the matching entry, floor)
    for i, (_, entries) in enumerate(FLOORS):
        for e in entries:
            if mod == e or (e.endswith((".", "_")) and mod.startswith(e)):
                if best is None or len(e) > best[0]:
                    best = (len(e), i)
    return None if best is None else best[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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


def test_every_module_has_a_floor():
    unplaced = sorted(m for m in module_files() if floor_of(m) is None)
    assert not unplaced, f"give these modules a floor in tests/test_layers.py FLOORS: {unplaced}"


def test_no_import_cycles_counting_imports_inside_functions():
    found = cycles(import_graph(module_files()))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_nothing_imports_upward():
    graph = import_graph(module_files())
    upward = [f"{m} (floor '{FLOORS[floor_of(m)][0]}') imports {t} (floor '{FLOORS[floor_of(t)][0]}')"
              for m in sorted(graph) for t in sorted(graph[m])
              if floor_of(m) is not None and floor_of(t) is not None and floor_of(t) > floor_of(m)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_contract_sees_imports_inside_functions(tmp_path):
    """The checker itself: a function-level import is an edge, a TYPE_CHECKING one is not, relative imports
    resolve, and a two-module cycle made only of lazy imports is found."""
    pkg = tmp_path / "omni"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from omni.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from omni import c\n"
                                      "def g():\n    from .. import a\n")
    (pkg / "c.py").write_text("import omni.a\n")
    global OMNI
    saved, OMNI = OMNI, pkg
    try:
        graph = import_graph(module_files())
    finally:
        OMNI = saved
    assert graph["omni.a"] == {"omni.sub.b"}
    assert graph["omni.sub.b"] == {"omni.a"}
    assert graph["omni.c"] == {"omni.a"}
    assert cycles(graph) == [["omni.a", "omni.sub.b"]]


def test_tokenizers_read_no_data_sets():
    """A tokenizer encodes samples; reading corpora and datasets is the data builders' (omni.data.corpora,
    omni.data.builders_text), so the tokenizer layer never imports omni.data."""
    graph = import_graph(module_files())
    reads = [f"{m} -> {t}" for m in sorted(graph) if m.startswith("omni.tokenizers")
             for t in sorted(graph[m]) if t == "omni.data" or t.startswith("omni.data.")]
    assert not reads, reads
