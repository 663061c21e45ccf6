"""leantune's parts depend on each other in one direction (docs/architecture.md).

The import graph is read from the source with `ast`, imports inside functions and under
`TYPE_CHECKING` included (an import placed in a function hides a cycle from Python without removing
it). Three rules:
- no import cycle between any two modules of leantune;
- every import between two parts (a top-level module, or a subpackage of leantune) goes from a
  higher layer of LAYERS to a strictly lower one. A new part must be given a layer here;
- inside models/, a family folder (models/<family>/) imports only the shared modules of models/
  and the layers below, never another family's folder: what two families share (BFL's key naming,
  used by Flux.1 and FLUX.2) is a shared module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "leantune"

# Bottom to top. A part imports only parts of lower layers (docs/architecture.md says why).
LAYERS: list[tuple[str, ...]] = [
    ("family_registry",),                          # every family by name (config reads it): imports nothing
    ("config", "io", "disk", "quiet", "spec", "errors", "host", "native", "resources"),   # facts, formats, data files, the C build
    ("memory",),                                   # the engine: streaming, fp8, checkpointing, plans
    ("accelerate_setup",),                         # the Accelerator and DeepSpeed config of a run
    ("distributed",),                              # process groups, collectives, launch
    ("models",),                                   # families: spec data, loading, schedules, keys
    ("data",),                                     # datasets, buckets, latent/text caches
    ("train",),                                    # training techniques: modes, LoRA, optimizers, state
    ("planner",),                                  # prices plans, using the modes' facts and probes
    ("infer",),                                    # staged sampling on a plan
    ("tiny",),                                     # tiny presets of the real classes (demo, tests): no loader's
    ("trainer", "demo_vae"),                       # the training loop; the demo's hand-set VAE
    ("demo", "simulated_run", "check"),            # the demo run; the simulated-GPU harness; leantune check's runs
    ("commands",),                                 # one module per CLI verb
    ("ui",),                                       # the page over the commands
    ("cli",),
    ("__main__",),
]


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in the file)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    top = root.name

    def resolve(current: str, node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            if node.level:
                base = current.split(".")
                if files[current].name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]
        found = []
        for name in names:
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name.split(".")[0] == top and name != current:
                found.append(name)
        return found

    graph = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets.update(resolve(name, node))
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
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
                        out.append(sorted(component))
    return out


def part_of(module: str) -> str:
    """leantune.planner.feedback.oom -> planner; leantune.cli -> cli; leantune -> (the package)."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else ""


def layer_violations(graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    level = {part: i for i, parts in enumerate(layers) for part in parts}
    problems = []
    for module, targets in sorted(graph.items()):
        a = part_of(module)
        for target in sorted(targets):
            b = part_of(target)
            if a == b or "" in (a, b):
                continue
            if level[a] <= level[b]:
                problems.append(f"{module} imports {target}: {a} (layer {level[a]}) must not import "
                                f"{b} (layer {level[b]})")
    return problems


def family_of(module: str, models: str) -> str | None:
    """leantune.models.flux.loading -> "flux"; a shared module of models/ (or outside it) -> None."""
    prefix = models + "."
    if not module.startswith(prefix):
        return None
    rest = module[len(prefix):].split(".")
    return rest[0] if len(rest) > 1 or _is_package(module) else None


_PACKAGES: set[str] = set()


def _is_package(module: str) -> bool:
    return module in _PACKAGES


def family_violations(graph: dict[str, set[str]], models: str) -> list[str]:
    """Imports from one family folder into another's (shared modules of models/ are free to use)."""
    problems = []
    for module, targets in sorted(graph.items()):
        mine = family_of(module, models)
        if mine is None:
            continue
        for target in sorted(targets):
            theirs = family_of(target, models)
            if theirs is not None and theirs != mine:
                problems.append(f"{module} imports {target}: family folder {mine}/ must not import "
                                f"another family's folder ({theirs}/); move what both use to a shared "
                                f"module of models/")
    return problems


# -- the checks can fail: a small package with the faults they look for ----------------------------

def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_cycle_hidden_in_a_function_is_found(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import g\n\ndef f():\n    return g()\n",
        "b.py": "def g():\n    from .sub.c import h\n    return h()\n",
        "sub/__init__.py": "",
        "sub/c.py": "def h():\n    from ..a import f\n    return 1\n",
    })
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_an_upward_import_between_parts_is_found(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "low.py": "def f():\n    import pkg.high.mod\n",
        "high/__init__.py": "",
        "high/mod.py": "from ..low import f\n",
    })
    graph = import_graph(pkg)
    assert cycles(graph) == [["pkg.high.mod", "pkg.low"]]
    assert layer_violations(graph, [("low",), ("high",)]) == [
        "pkg.low imports pkg.high.mod: low (layer 0) must not import high (layer 1)"]


def test_an_import_between_two_family_folders_is_found(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "models/__init__.py": "",
        "models/shared.py": "X = 1\n",
        "models/a/__init__.py": "from ..shared import X\n",
        "models/a/keys.py": "from ..b.keys import Y\n",
        "models/b/__init__.py": "",
        "models/b/keys.py": "from ..shared import X\nY = X\n",
    })
    graph = import_graph(pkg)
    _PACKAGES.update(m for m in graph if (pkg.parent / m.replace(".", "/") / "__init__.py").is_file())
    assert family_violations(graph, "pkg.models") == [
        "pkg.models.a.keys imports pkg.models.b.keys: family folder a/ must not import another "
        "family's folder (b/); move what both use to a shared module of models/"]


# -- leantune itself -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph():
    return import_graph(PACKAGE)


def test_every_part_has_a_layer(graph):
    placed = {part for parts in LAYERS for part in parts}
    missing = sorted({part_of(m) for m in graph} - placed - {""})
    assert not missing, f"give these parts a layer in LAYERS (and docs/architecture.md): {missing}"


def test_no_import_cycle_between_modules(graph):
    assert cycles(graph) == []


def test_parts_import_only_lower_layers(graph):
    assert layer_violations(graph, LAYERS) == []


def test_family_folders_import_no_other_family(graph):
    _PACKAGES.update(m for m in graph if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").is_file())
    assert family_violations(graph, "leantune.models") == []


def test_no_loader_imports_the_tiny_presets(graph):
    """The tiny presets are the demo's and the tests': models/, data/, train/, planner/ and infer/
    never import them (LAYERS puts them above infer/; this names the rule on its own)."""
    below = {"models", "data", "train", "planner", "infer", "memory"}
    offenders = [f"{m} imports {t}" for m, ts in sorted(graph.items()) for t in sorted(ts)
                 if part_of(t) == "tiny" and part_of(m) in below]
    assert offenders == []


def test_only_the_family_seam_is_used_outside_models(graph):
    """The trainer, caches, planner, engine, sampler and commands never import a family's folder:
    they ask models.family.get_family (docs/architecture.md)."""
    _PACKAGES.update(m for m in graph if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").is_file())
    offenders = [f"{m} imports {t}" for m, ts in sorted(graph.items()) for t in sorted(ts)
                 if not m.startswith("leantune.models.") and family_of(t, "leantune.models") is not None]
    assert offenders == []
