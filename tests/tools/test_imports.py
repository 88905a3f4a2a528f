"""Imports run one way (docs/architecture.md, "Layers"): no import circle between the package's
files, and no import from a lower layer to a higher one. Every import counts, a function-level
one too: an in-function import breaks a real cost (an optional heavy dependency), not a rule."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: The layers, lowest first: a module may import its own layer and the ones below. The longest
#: matching prefix places a module (``dflash_lab.train.cli`` is a stage command, the rest of
#: ``dflash_lab.train`` is training). docs/architecture.md, "Layers", is this table in words.
LAYERS = (
    ("foundation", ("dflash_lab", "dflash_lab.errors", "dflash_lab.dtypes", "dflash_lab.paths",
                    "dflash_lab.checksums", "dflash_lab.launch", "dflash_lab.writer_lock",
                    "dflash_lab.runinfo", "dflash_lab.terminal")),
    ("serving clients", ("dflash_lab.serving",)),
    ("attention", ("dflash_lab.attention",)),
    ("model", ("dflash_lab.model",)),
    ("targets", ("dflash_lab.targets",)),
    ("data", ("dflash_lab.data",)),
    ("export", ("dflash_lab.export",)),
    ("train", ("dflash_lab.train",)),
    ("eval", ("dflash_lab.eval",)),
    ("heads", ("dflash_lab.heads",)),
    ("stage commands", ("dflash_lab.capture", "dflash_lab.regenerate", "dflash_lab.taps",
                        "dflash_lab.entry", "dflash_lab.train.cli", "dflash_lab.train.run",
                        "dflash_lab.eval.cli", "dflash_lab.export.cli")),
    ("orchestrator", ("dflash_lab.pipeline", "dflash_lab.pipeline_args")),
    ("console", ("dflash_lab.commands",)),
)


def module_files() -> dict[str, Path]:
    """Module name -> file, for dflash_lab/ and the top-level export/ (``dflash_lab.export``)."""
    out = {}
    for top, prefix in (("dflash_lab", ("dflash_lab",)), ("export", ("dflash_lab", "export"))):
        for path in (REPO / top).rglob("*.py"):
            parts = [*prefix, *path.relative_to(REPO / top).with_suffix("").parts]
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in the file)."""
    graph = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                wanted = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # ``from pkg import submodule`` imports the submodule; any other name, pkg
                wanted = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files
                          else node.module for a in node.names]
            else:
                continue
            for dotted in wanted:
                while dotted and dotted not in files:
                    dotted = dotted.rpartition(".")[0]
                if dotted not in ("", "dflash_lab", name) and dotted.startswith("dflash_lab"):
                    targets.add(dotted)
        graph[name] = targets
    return graph


def layer_of(module: str) -> int:
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, (f"{module} is in no layer: add it to LAYERS here and to "
                              "docs/architecture.md, Layers")
    return best[1]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    found = circles(import_graph(module_files()))
    assert not found, f"import circles: {found}: move what both need to the lower file"


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    graph = import_graph(module_files())
    upward = sorted(f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
                    for a, targets in graph.items() for b in targets
                    if layer_of(b) > layer_of(a))
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_the_checks_find_what_they_look_for():
    """The two checks are not vacuous: a made-up circle and an upward import are found."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("dflash_lab.train.cli") > layer_of("dflash_lab.train.loss")
    assert layer_of("dflash_lab.model.config") < layer_of("dflash_lab.export.api")
    graph = import_graph(module_files())
    assert "dflash_lab.model.config" in graph["dflash_lab.model.drafter"]
    assert "dflash_lab.pipeline" in graph["dflash_lab.commands"]  # an in-function import counts
