"""The package's layers, checked from the source: no import cycle, no import up the layers, and no code
outside flowrl/algorithms and the registry that branches on an algorithm's name.

Every import counts, including those inside functions (they hid cycles before). Run this file directly to
print the import report: ``python tests/test_layers.py``.
"""

from __future__ import annotations

import ast
import fnmatch
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the source folders and the package names they install as (pyproject's package-dir)
SOURCES = {"flowrl": ROOT / "flowrl", "flowrl.rewards": ROOT / "rewards", "flowrl.samplers": ROOT / "samplers"}
# top to bottom: a module may import its own layer and the layers below, never one above
LAYERS = [
    ("cli", ["flowrl.cli", "flowrl.cli.*", "flowrl.__main__"]),
    ("shapes demo (leaf)", ["flowrl.shapes", "flowrl.shapes.*"]),
    ("eval / bench", ["flowrl.evaluate", "flowrl.bench", "flowrl.gpu_bench", "flowrl.gpu_check", "flowrl.gpu_plan", "flowrl.credit"]),
    ("train", ["flowrl.trainer", "flowrl.callbacks", "flowrl.optimise", "flowrl.rollout_runner",
               "flowrl.candidate_pool", "flowrl.policy", "flowrl.checkpoint", "flowrl.sharded_checkpoint",
               "flowrl.rundir", "flowrl.distributed", "flowrl.sharding", "flowrl.throughput", "flowrl.memory", "flowrl.stop_signal",
               "flowrl.guard"]),
    ("algorithms", ["flowrl.algorithms", "flowrl.algorithms.*"]),
    ("objectives / losses / advantages", ["flowrl.objectives", "flowrl.advantages", "flowrl.losses", "flowrl.trees", "flowrl.chunks", "flowrl.trackers"]),
    ("rewards / rollout / prompts", ["flowrl.rewards", "flowrl.rewards.*", "flowrl.engine", "flowrl.sampling",
                                     "flowrl.prompts"]),
    ("models", ["flowrl.models", "flowrl.models.*"]),  # an adapter knows its pipeline's sigma schedule
    ("plan / kernels", ["flowrl.samplers", "flowrl.samplers.*"]),
    ("config / errors / io", ["flowrl", "flowrl.config", "flowrl.config.*", "flowrl.errors", "flowrl.registry", "flowrl.resources",
                              "flowrl.tokenizer", "flowrl.report", "flowrl.report.*", "flowrl.cli_types",
                              "flowrl.digests", "flowrl.attention", "flowrl.low_precision", "flowrl.editing",
                              "flowrl.randomness"]),
]


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "flowrl" and parts and parts[0] in ("rewards", "samplers"):
                continue
            out[name] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules imported anywhere in the file (relative imports resolved; ``from a import b`` counts
    ``a.b`` when that is a module, else ``a``)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def layer_of(name: str) -> int:
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return i
    raise AssertionError(f"{name} is in no layer; add it to LAYERS in tests/test_layers.py")


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports(m, p, known) for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
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

    sys.setrecursionlimit(10000)
    for v in g:
        if v not in index:
            visit(v)
    return out


def upward(g: dict[str, set[str]]) -> list[str]:
    return [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
            for m, ts in g.items() for t in sorted(ts) if layer_of(t) < layer_of(m)]


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_runs_up_the_layers():
    assert upward(graph()) == []


def test_every_module_has_a_layer():
    for m in modules():
        layer_of(m)


def _algorithm_names() -> set[str]:
    """Registered algorithm names, less "flow_grpo", which also names a step kernel and reward conventions
    (those comparisons are caught by the ``.name`` rule below when they test an algorithm)."""
    from flowrl.registry import ALGORITHMS

    return set(ALGORITHMS) - {"flow_grpo"}


def _branches_on_names(tree: ast.AST, names: set[str]) -> list[int]:
    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return False

    def algorithm_name(node) -> bool:  # cfg.algorithm.name, algorithm.name, ...
        return any(isinstance(n, ast.Attribute) and n.attr == "name" and "algorithm" in ast.unparse(n.value)
                   for n in ast.walk(node))

    lines = []
    for node in ast.walk(tree):
        operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
        if any(named(x) for x in operands) or any(algorithm_name(x) for x in operands):
            lines.append(node.lineno)
        if isinstance(node, ast.Dict) and any(k is not None and named(k) for k in node.keys):
            lines.append(node.lineno)
        if isinstance(node, ast.match_case) and isinstance(node.pattern, ast.MatchValue) and named(node.pattern.value):
            lines.append(node.pattern.lineno)
    return lines


def test_no_code_outside_algorithms_branches_on_an_algorithm_name():
    names = _algorithm_names()
    found = {}
    for m, path in modules().items():
        if m.startswith("flowrl.algorithms") or m == "flowrl.registry":
            continue
        lines = _branches_on_names(ast.parse(path.read_text()), names)
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    assert found == {}


def test_the_name_check_catches_a_branch():
    src = ('if cfg.algorithm.name == "chunk_grpo":\n    pass\nx = name in ("superflow", "other")\ny = {"e_grpo": 1}\n'
           'z = a.algorithm.name == "flow_grpo"\nk = kernel == "flow_grpo"')
    assert _branches_on_names(ast.parse(src), _algorithm_names()) == [1, 3, 4, 5]


if __name__ == "__main__":  # the report for humans
    g = graph()
    for i, (label, _) in enumerate(LAYERS):
        members = sorted(m for m in g if layer_of(m) == i)
        print(f"{i}. {label}: {len(members)} modules")
    edges = sum(len(v) for v in g.values())
    print(f"{len(g)} modules, {edges} import edges; cycles: {cycles(g) or 'none'}; "
          f"upward imports: {upward(g) or 'none'}")


TRAINER_MODULES = ["flowrl.trainer", "flowrl.optimise", "flowrl.rollout_runner", "flowrl.callbacks"]


def test_the_trainer_never_asks_what_kind_of_algorithm_it_has():
    """The trainer drives every algorithm through the same hooks and objective protocol: no flag naming a kind
    of algorithm (forward-process training, GRPO-Guard), no algorithm name, no isinstance test on an algorithm."""
    mods = modules()
    names = _algorithm_names() | {"flow_grpo"}
    for m in TRAINER_MODULES:
        source = mods[m].read_text()
        tree = ast.parse(source)
        for word in ("forward_process", "grpo_guard", "per_edge_rows"):
            assert word not in source, (m, word)
        constants = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not constants & names, (m, constants & names)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance":
                assert "algo" not in ast.unparse(node.args[0]), (m, ast.unparse(node))


def test_the_core_never_imports_the_shapes_demo():
    """The shapes demo is a leaf: no module outside flowrl.shapes imports it (it registers itself)."""
    g = graph()
    found = {m: sorted(t for t in ts if t.startswith("flowrl.shapes")) for m, ts in g.items()
             if not m.startswith("flowrl.shapes")}
    assert {m: ts for m, ts in found.items() if ts} == {}
    # nor names its modules: only the registries' entries point into it
    registries = {"flowrl.registry", "flowrl.rewards.registry"}
    naming = [m for m, path in modules().items() if not m.startswith("flowrl.shapes") and m not in registries
              and "flowrl.shapes" in path.read_text()]
    assert naming == []


def test_every_package_folder_is_in_the_distribution():
    """pyproject's package list names every folder of flowrl/ that is a package (a missing one installs a wheel
    without it, as the command-line package once was)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"flowrl." + p.parent.relative_to(ROOT / "flowrl").as_posix().replace("/", ".")
               for p in (ROOT / "flowrl").rglob("__init__.py") if p.parent != ROOT / "flowrl"}
    assert folders <= listed, folders - listed
