"""The structure of the package stays as docs/architecture.md documents it.

- Imports between the parts of ``hpcpar`` (its subpackages and top-level modules) go only
  downward in the documented layer order, and never form a cycle (function-level imports
  count too: they are dependencies all the same).
- No function is longer than 80 lines.
- The training loop and the checkpoint package never ask what type an optimizer or a
  strategy is: they use the Strategy interface and the checkpoint protocol.
"""
import ast
import pathlib
import re
import shutil

import pytest

from conftest import REPO

PACKAGE = pathlib.Path(REPO) / "hpcpar"
DOC = pathlib.Path(REPO) / "docs" / "architecture.md"
MAX_FUNCTION_LINES = 80


def documented_layers(doc: pathlib.Path = DOC) -> dict[str, int]:
    """{part: layer} from the table between the layer markers of the architecture document."""
    text = doc.read_text()
    table = text[text.index("<!-- layers"):text.index("<!-- end layers -->")]
    layers = {}
    for layer, parts in re.findall(r"^\|\s*(\d+)\s*\|\s*([^|]+)\|", table, re.M):
        for part in parts.split(","):
            layers[part.strip()] = int(layer)
    return layers


def part_of(module: str) -> str:
    """hpcpar.parallel.zero -> parallel; hpcpar.state -> state; hpcpar -> hpcpar."""
    bits = module.split(".")
    return bits[1] if len(bits) > 1 else bits[0]


def import_edges(package: pathlib.Path) -> dict[tuple[str, str], str]:
    """{(importing part, imported part): "file:line" of the first such import}."""
    edges = {}
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package.parent).with_suffix("")
        module = ".".join(relative.parts).removesuffix(".__init__")
        here = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    targets = [".".join(base + [node.module])] if node.module else \
                        [".".join(base + [alias.name]) for alias in node.names]
                else:
                    targets = [node.module or ""]
            else:
                continue
            for target in targets:
                if target == "hpcpar" or target.startswith("hpcpar."):
                    edge = (part_of(module), part_of(target))
                    if edge[0] != edge[1]:
                        edges.setdefault(edge, f"{relative}.py:{node.lineno}")
    return edges


def layering_problems(edges: dict, layers: dict) -> list[str]:
    problems = [f"{part} is in no layer of docs/architecture.md ({where})"
                for (src, dst), where in edges.items() for part in (src, dst) if part not in layers]
    problems += [f"{src} (layer {layers[src]}) imports {dst} (layer {layers[dst]}) at {where}: upward"
                 for (src, dst), where in edges.items()
                 if src in layers and dst in layers and layers[dst] > layers[src]]
    return problems + [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(edges)]


def cycles(edges: dict) -> list[list[str]]:
    """One cycle through each strongly connected group of parts (Tarjan's algorithm)."""
    graph: dict[str, set] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group) + [sorted(group)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_follow_the_documented_layers():
    assert layering_problems(import_edges(PACKAGE), documented_layers()) == []


def test_every_part_of_the_package_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    parts = {"hpcpar" if p == "__init__" else p for p in parts}
    assert parts - set(documented_layers()) == set()


@pytest.mark.parametrize("planted, expected", [
    ("runtime/comm.py", "runtime (layer 1) imports train (layer 6)"),  # a reverse import
    ("autograd/function.py", "autograd (layer 2) imports train (layer 6)"),
])
def test_a_planted_reverse_import_is_caught(tmp_path, planted, expected):
    copy = tmp_path / "hpcpar"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / planted
    target.write_text(target.read_text() + "\n\ndef _planted():\n    from ..train import loop  # noqa\n")
    problems = layering_problems(import_edges(copy), documented_layers())
    assert any(expected in p for p in problems), problems


def test_a_planted_cycle_is_caught(tmp_path):
    copy = tmp_path / "hpcpar"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "nn" / "_planted.py").write_text("from ..optim import SGD  # noqa\n")
    (copy / "optim" / "_planted.py").write_text("from ..nn import Module  # noqa\n")
    problems = layering_problems(import_edges(copy), documented_layers())
    assert "import cycle: nn -> optim -> nn" in problems


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_the_training_loop_reads_top_to_bottom():
    tree = ast.parse((PACKAGE / "train" / "loop.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert ast.get_docstring(train) and train.end_lineno - train.lineno + 1 <= 60
    assert "mode" not in ast.unparse(train)  # no branch on how the replicas agree


@pytest.mark.parametrize("folder", ["train", "checkpoint"])
def test_no_type_sniffing_of_optimizers_or_strategies(folder):
    """``hasattr``/``isinstance`` in train/ and checkpoint/ only on values, never on what an
    optimizer, ZeRO, a parameter server or a strategy is."""
    suspicious = re.compile(r"(hasattr|isinstance)\([^)]*(optim|zero|strategy|ps\b|engine|mode|Zero|Parameter"
                            r"Server|Strategy)", re.I)
    found = [f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
             for path in sorted((PACKAGE / folder).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if suspicious.search(line)]
    assert found == []
