"""The package's layers point down only, every module placed (`LAYERS`): the small shared modules, the model, the
default models and loading, scheduling, generation, training, evaluation, cards, the Hub, the CLI.

Every import of every module counts, the ones inside functions too: an import moved into a function to dodge a
cycle is still a dependency.
"""

import ast
import functools
from pathlib import Path

import pytest

import dspark_hf

PACKAGE = Path(dspark_hf.__file__).parent


def modules() -> dict[str, Path]:
    """dotted name -> file of every module of the package (a package as its __init__), assets aside."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "assets" in parts:  # copies of the model files, saved beside a shipped draft's weights
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, wherever in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from package import module` imports the module; `from module import name` the module itself
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import dspark_hf.model.sampling` -> that module
                target = target.rpartition(".")[0]
            if target.startswith("dspark_hf"):
                out.add(target)
    return out - {name}


@functools.cache  # parsing every module is the slow part, and the files do not change during a run
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


# the package's layers, lowest first: a module may import its own layer and those below it, never one above
LAYERS = [
    # small modules everything uses
    ("shared", {"version", "errors", "installs", "files", "devices", "options", "internals", "eos"}),
    ("model", {"model"}),
    ("defaults", {"defaults", "loading"}),  # the embedded target and draft, and how commands load models
    ("costs", {"costs"}),  # machine measurement: what the engine's steps cost here, measured and modelled
    ("scheduling", {"scheduling"}),
    ("generation", {"generation"}),
    ("training", {"training"}),
    ("evaluation", {"evaluation"}),
    ("cards", {"cards"}),
    ("hub", {"hub"}),
    ("cli", {"cli", "__main__"}),
]
RANK = {part: rank for rank, (_, parts) in enumerate(LAYERS) for part in parts}


def layer_of(module: str) -> int | None:
    """The rank of a module's layer (None: the package's own __init__, the public API, which may import any layer
    below the CLI)."""
    parts = module.split(".")
    return None if len(parts) == 1 else RANK[parts[1]]


def test_every_module_of_the_package_has_a_layer():
    unplaced = sorted({name.split(".")[1] for name in graph() if "." in name} - set(RANK))
    assert not unplaced, f"place {unplaced} in LAYERS (and in docs/design.md's order)"


@pytest.mark.parametrize("rank", range(len(LAYERS)), ids=[name for name, _ in LAYERS])
def test_no_module_imports_a_layer_above_its_own(rank):
    for name, targets in graph().items():
        if layer_of(name) == rank:
            upward = sorted(t for t in targets if layer_of(t) is None or layer_of(t) > rank)
            assert not upward, f"{name} imports {upward}, above its layer ({LAYERS[rank][0]}): pass what it needs in"


def test_the_public_api_imports_no_command():
    assert not {t for t in graph()["dspark_hf"] if layer_of(t) == RANK["cli"]}


def test_docs_design_states_the_whole_order():
    design = " ".join((PACKAGE.parent / "docs" / "design.md").read_text().split())
    order = " < ".join(name for name, _ in LAYERS)
    assert order in design, f"docs/design.md should state the layers' order: {order}"


def test_no_module_imports_one_that_imports_it_back():
    """No cycle, not even through a package's __init__ (the root's included): `from .. import __version__` in a
    module that the root imports is one."""
    edges, state, path = graph(), {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
