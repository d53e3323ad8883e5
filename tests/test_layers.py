"""The package's layers point down only: model, then scheduling, then generation, then evaluation and training.

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


ABOVE = {  # a layer -> the layers above it that none of its modules may import, and what a failure adds
    "dspark_hf.scheduling": (("dspark_hf.generation", "dspark_hf.evaluation"),
                             ": scheduling sits below both (pass what it needs in)"),
    "dspark_hf.model": (tuple(f"dspark_hf.{layer}" for layer in ("generation", "scheduling", "training", "evaluation",
                                                                  "hub", "cards", "loading", "defaults", "cli")),
                        ": the model layer sits below them"),
    "dspark_hf.generation": (("dspark_hf.evaluation", "dspark_hf.training", "dspark_hf.cli"), ""),
}


@pytest.mark.parametrize("layer", list(ABOVE))
def test_no_layer_imports_one_above_it(layer):
    above, why = ABOVE[layer]
    for name, targets in graph().items():
        if name.startswith(layer):
            upward = sorted(t for t in targets if t.startswith(above))
            assert not upward, f"{name} imports {upward}{why}"


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
