"""The structure of the package stays as docs/architecture.md documents it.

- Imports between the parts of ``hpcpar`` (its subpackages and top-level modules) go only
  downward in the documented layer order, and never form a cycle (function-level imports
  count too: they are dependencies all the same).
- The modules inside each part import one another without a cycle either, but for the named
  exceptions (``MODULE_CYCLE_EXCEPTIONS``).
- No function is longer than 60 lines, but for the named tables of data (``TABLE_LIKE_FUNCTIONS``).
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
MAX_FUNCTION_LINES = 60
# Functions allowed to be longer, each a table of data rather than steps (docs/architecture.md):
# {"hpcpar/<path>.py:<function>": why it is a table}.
TABLE_LIKE_FUNCTIONS: dict[str, str] = {}


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


def modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
    """{dotted module name: its file}: hpcpar/plan/memory.py -> hpcpar.plan.memory."""
    return {".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): path
            for path in sorted(package.rglob("*.py"))}


def imports(package: pathlib.Path):
    """(importing module, imported module, "file:line") for every import of ``hpcpar`` in the
    package, at module level or inside a function (``from .memory import Memory`` in
    hpcpar/plan/predict.py imports hpcpar.plan.memory; ``from . import deferred`` in
    hpcpar/autograd/tensor.py, hpcpar.autograd.deferred)."""
    known = modules(package)
    for module, path in known.items():
        here = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target not in known and "." in target:  # an attribute of a module: the module
                    target = target.rsplit(".", 1)[0]
                if target in known:
                    yield module, target, f"{path.relative_to(package.parent)}:{node.lineno}"


def import_edges(package: pathlib.Path) -> dict[tuple[str, str], str]:
    """{(importing part, imported part): "file:line" of the first such import}."""
    edges = {}
    for module, target, where in imports(package):
        edge = (part_of(module), part_of(target))
        if edge[0] != edge[1]:
            edges.setdefault(edge, where)
    return edges


def module_edges(package: pathlib.Path) -> dict[tuple[str, str], str]:
    """{(importing module, imported module): "file:line" of the first such import} inside each part."""
    edges = {}
    for module, target, where in imports(package):
        if target != module and part_of(target) == part_of(module):
            edges.setdefault((module, target), where)
    return edges


# The imports that may close a cycle between the modules of one part, each with its reason
# (docs/architecture.md names them). Both are imports inside a function, made when first called.
MODULE_CYCLE_EXCEPTIONS = {
    ("hpcpar.autograd.tensor", "hpcpar.autograd.ops"): "a Tensor's operators (+, @, sum) are the ops",
    ("hpcpar.autograd.function", "hpcpar.autograd.tensor"): "an op's apply returns a Tensor",
}


def module_cycle_problems(edges: dict) -> list[str]:
    """The cycles between the modules of one part, less the named exceptions, and any exception
    that is no longer an import (so that the list stays true)."""
    stale = [f"{src} no longer imports {dst}: drop it from MODULE_CYCLE_EXCEPTIONS"
             for src, dst in MODULE_CYCLE_EXCEPTIONS if (src, dst) not in edges]
    kept = {edge: where for edge, where in edges.items() if edge not in MODULE_CYCLE_EXCEPTIONS}
    return stale + [f"module import cycle: {' -> '.join(cycle)} (first import at {kept[cycle[0], cycle[1]]})"
                    for cycle in cycles(kept)]


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
                found.append(cycle_through(min(group), set(group), graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycle_through(start: str, group: set, graph: dict) -> list[str]:
    """The shortest cycle from ``start`` back to it inside ``group`` (a strongly connected group)."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph.get(path[-1], ())):
            if w == start:
                return path + [start]
            if w in group and w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"{start} is on no cycle of {sorted(group)}")


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


def test_no_import_cycle_between_the_modules_of_a_part():
    assert module_cycle_problems(module_edges(PACKAGE)) == []


@pytest.mark.parametrize("planted, line, cycle", [
    # plan/predict.py imports plan/traffic.py at module level: a function-level import back
    ("plan/traffic.py", "    from .predict import StepPlan  # noqa", ("plan.predict", "plan.traffic")),
    # autograd/tensor.py imports autograd/precision.py: the autograd exceptions hide no other cycle
    ("autograd/precision.py", "    from .tensor import Tensor  # noqa", ("autograd.precision", "autograd.tensor")),
])
def test_a_planted_module_cycle_is_caught(tmp_path, planted, line, cycle):
    copy = tmp_path / "hpcpar"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / planted
    target.write_text(target.read_text() + f"\n\ndef _planted():\n{line}\n")
    problems = module_cycle_problems(module_edges(copy))
    assert len(problems) == 1 and all(f"hpcpar.{module} ->" in problems[0] for module in cycle), problems


def test_a_planted_cycle_is_caught(tmp_path):
    copy = tmp_path / "hpcpar"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "nn" / "_planted.py").write_text("from ..optim import SGD  # noqa\n")
    (copy / "optim" / "_planted.py").write_text("from ..nn import Module  # noqa\n")
    problems = layering_problems(import_edges(copy), documented_layers())
    assert "import cycle: nn -> optim -> nn" in problems


def test_no_function_is_longer_than_60_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                name = f"{path.relative_to(PACKAGE.parent)}:{node.name}"
                if lines > MAX_FUNCTION_LINES and name not in TABLE_LIKE_FUNCTIONS:
                    long.append(f"{name} at line {node.lineno} ({lines} lines)")
    assert long == []


def test_the_table_like_functions_exist_and_are_long():
    """Each exception to the length rule is still a function over the limit."""
    lengths = {f"{path.relative_to(PACKAGE.parent)}:{node.name}": node.end_lineno - node.lineno + 1
               for path in sorted(PACKAGE.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert {name: lengths.get(name) for name in TABLE_LIKE_FUNCTIONS
            if lengths.get(name, 0) <= MAX_FUNCTION_LINES} == {}


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
