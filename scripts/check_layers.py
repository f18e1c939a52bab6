"""The package's structure, counted from its own imports: layers, import circles, imports inside
functions and wide signatures.

    python scripts/check_layers.py          # one JSON report; exit status 1 when a rule is broken

Rules (tests/test_layers.py holds them):

* **Layers.** Every module of graft_spec belongs to one layer of `LAYERS` and imports only modules
  of its own layer or below it: pure math <- fused ops <- state <- the round <- the planner <-
  the package; the adapters (sglang_patch, vllm_worker) sit on top.
* **No import circles** among the project's modules, function-level and type-only imports
  included (Tarjan's strongly connected components of the import graph).
* **No imports of the project's own modules inside functions**, except `LAZY`: imports an entry
  point defers so that processes which never run that code do not import it.
* **No public function with more than 10 parameters** (``self`` / ``cls`` aside), except `ENGINE_SIGNATURES`:
  functions that stand in for an engine function and so take its parameters.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("graft_spec", "sglang_patch", "vllm_worker")
MAX_PARAMS = 10

#: graft_spec's layers, lowest first: (name, module prefixes). A module takes the layer of its
#: longest matching prefix; the adapters are above all of them.
LAYERS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("base", ("graft_spec.sources", "graft_spec.config")),
    ("pure math", ("graft_spec.numerics", "graft_spec.tree")),
    ("fused ops", ("graft_spec.kernels",)),
    ("state", ("graft_spec.calibration", "graft_spec.request_correction", "graft_spec.history",
               "graft_spec.retrieval")),
    ("round", ("graft_spec.device_sources", "graft_spec.step", "graft_spec.merge", "graft_spec.prune",
               "graft_spec.gate", "graft_spec.chain", "graft_spec.verify", "graft_spec.metrics", "graft_spec.stats",
               "graft_spec.budget")),
    ("planner", ("graft_spec.graphs", "graft_spec.pipeline")),
    ("package", ("graft_spec",)),
    ("adapters", ("sglang_patch", "vllm_worker")),
)

#: (module, imported module): function-level imports kept on purpose, with the reason.
LAZY: Dict[Tuple[str, str], str] = {
    ("sglang_patch.registration", "sglang_patch.graft_worker"):
        "SGLang's worker factory: only scheduler processes import the worker and its model stack",
    ("sglang_patch.cpu", "sglang_patch.cpu.hooks"):
        "the CPU execution layer: its op replacements are imported only where no CUDA device is",
    ("sglang_patch.cpu", "sglang_patch.cpu.reconstruct_tree"):
        "the CPU stand-in for an sgl_kernel module, imported only when sgl_kernel is absent",
    ("vllm_worker.plugin", "vllm_worker.proposer"):
        "vLLM's plugin entry: only a model runner with method graft imports the proposer's GPU stack",
    ("vllm_worker.plugin", "vllm_worker.tree_attention"):
        "vLLM's plugin entry: only a graft runner that verifies trees imports vLLM's CPU attention backend",
    ("vllm_worker.plugin", "vllm_worker.tree_attention_gpu"):
        "vLLM's plugin entry: only a graft runner that verifies trees on CUDA imports vLLM's FlashAttention backend",
    ("vllm_worker.plugin", "vllm_worker.tree_runner"):
        "vLLM's plugin entry: only a graft runner that verifies trees imports vLLM's sampler stack",
}

#: (module, function): replacements of an engine function, which keep its parameters.
ENGINE_SIGNATURES: Dict[Tuple[str, str], str] = {
    ("sglang_patch.tree_sampling", "tree_speculative_sampling_target_only"):
        "SGLang kernels/ops/speculative/sampling.py:33 tree_speculative_sampling_target_only",
    ("sglang_patch.cpu.tree_ops", "build_tree_kernel_efficient_func"):
        "SGLang speculative/spec_tree.py:367 build_tree_kernel_efficient_func",
    ("sglang_patch.cpu.cache_ops", "assign_extend_cache_locs_uniform_func"):
        "SGLang cache_locs.py:596 assign_extend_cache_locs_uniform_func",
}


def modules(root: Path = ROOT) -> Dict[str, Path]:
    """``{dotted module name: file}`` of every module of `PACKAGES` under ``root``."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _targets(mods: Dict[str, Path], current: str, node: ast.AST) -> List[str]:
    """The project modules an import statement names (a ``from pkg import name`` of a submodule
    names the submodule, else the package)."""
    def known(name: str) -> str:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    if isinstance(node, ast.Import):
        return [known(a.name) for a in node.names if a.name.split(".")[0] in PACKAGES]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = current.split(".")
        if mods[current].name != "__init__.py":
            base = base[:-1]
        base = base[:len(base) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    if module.split(".")[0] not in PACKAGES:
        return []
    return [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else known(module) for a in node.names]


def scan(root: Path = ROOT) -> dict:
    """The report: ``edges`` (module -> imported modules), ``inner`` function-level imports of
    project modules ``[(module, line, imported)]``, ``wide`` public functions with more than
    `MAX_PARAMS` parameters ``[(module, line, name, count)]``."""
    mods = modules(root)
    edges: Dict[str, Set[str]] = {m: set() for m in mods}
    inner, wide = [], []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        parent: Dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parent[child] = node
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = [t for t in _targets(mods, mod, node) if t != mod]
                edges[mod].update(targets)
                up = parent.get(node)
                while up is not None and not isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    up = parent.get(up)
                if up is not None:
                    inner.extend((mod, node.lineno, t) for t in targets)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owner = parent.get(node)
                if (node.name.startswith("_") and not node.name.startswith("__")) or isinstance(
                        owner, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                        isinstance(owner, ast.ClassDef) and owner.name.startswith("_")):
                    continue
                a = node.args
                count = len([x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")])
                count += int(a.vararg is not None) + int(a.kwarg is not None)
                if count > MAX_PARAMS:
                    wide.append((mod, node.lineno, node.name, count))
    return {"edges": edges, "inner": inner, "wide": wide}


def circles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in edges:
                continue
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

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str) -> int:
    """The index in `LAYERS` of ``module`` (its longest matching prefix)."""
    best, depth = len(LAYERS) - 1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    return best


def upward(edges: Dict[str, Set[str]]) -> List[Tuple[str, str]]:
    """Imports from a module into a higher layer ``[(module, imported)]``."""
    return sorted((m, t) for m, ts in edges.items() for t in ts if layer_of(t) > layer_of(m))


def report(root: Path = ROOT) -> dict:
    """Every rule's findings (the JSON this script prints); all lists empty = the rules hold."""
    s = scan(root)
    return {
        "circles": circles(s["edges"]),
        "upward_imports": [list(x) for x in upward(s["edges"])],
        "inner_imports": [list(x) for x in s["inner"] if (x[0], x[2]) not in LAZY],
        "wide_functions": [list(x) for x in s["wide"] if (x[0], x[2]) not in ENGINE_SIGNATURES],
        "lazy_imports_kept": sorted({f"{m} -> {t}" for m, _, t in s["inner"] if (m, t) in LAZY}),
        "engine_signatures_kept": sorted(f"{m}.{f}" for m, _, f, _ in s["wide"] if (m, f) in ENGINE_SIGNATURES),
        "modules": len(s["edges"]),
    }


def main() -> int:
    r = report()
    print(json.dumps(r, indent=1))
    return int(any(r[k] for k in ("circles", "upward_imports", "inner_imports", "wide_functions")))


if __name__ == "__main__":
    sys.exit(main())
