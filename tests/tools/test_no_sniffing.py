"""Entry code does not sniff types or class names (issue 28 item 4): what a run needs to know
about a data module or a logger is an attribute or method of it (``BlockDataModule.runs_target``,
``drafter_inputs``, ``check_config``, ``sequence_limit``), and logger-specific work lives in
callbacks (``dflash_lab.train.callbacks.WandbRun``).

The entry code is every module a console script names (pyproject's [project.scripts]) plus
:data:`WIRING` (what those call to wire a run). The checker reads their syntax trees, so strings
and comments do not count, and it is itself tested on the spellings it must catch and the ones
it must leave alone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Modules the entry points call to wire their parts together (besides the console scripts').
WIRING = ("dflash_lab/entry.py", "dflash_lab/train/run.py", "dflash_lab/train/checks.py",
          "dflash_lab/export/cli.py")
#: Class names that identify a logger or data module kind: never compared as strings.
_KIND_NAME = re.compile(r"(Logger|DataModule|Checkpoint)\b")
#: Methods that match a name's spelling.
_NAME_MATCH = {"endswith", "startswith"}
#: (file, line text) of allowed uses, each with its reason. Empty: none is needed today.
ALLOWED: dict[tuple[str, str], str] = {}


def entry_files() -> list[str]:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    modules = {target.split(":")[0] for target in scripts.values()}
    return sorted({m.replace(".", "/") + ".py" for m in modules} | set(WIRING))


def _mentions_config_target(node: ast.AST) -> bool:
    """``x._target_``, ``x["_target_"]`` or ``x.get("_target_")`` anywhere inside node."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr == "_target_":
            return True
        if isinstance(sub, ast.Constant) and sub.value == "_target_":
            return True
    return False


def _names_a_type(node: ast.AST) -> bool:
    """``type(x)``, ``x.__class__``, ``x.__name__`` / ``__qualname__``, or a string naming a
    logger / data module / checkpoint class."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type":
        return True
    if isinstance(node, ast.Attribute) and node.attr in {"__class__", "__name__",
                                                         "__qualname__"}:
        return True
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(
        _KIND_NAME.search(node.value))


def sniffing(source: str) -> list[tuple[int, str]]:
    """(line, what) of each type or name sniff in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_a_type(s) for s in sides):
                found.append((node.lineno, "compares a type or class name"))
            elif any(_mentions_config_target(s) for s in sides):
                found.append((node.lineno, "compares a config's _target_"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in _NAME_MATCH and (_mentions_config_target(node.func.value)
                                                     or _names_a_type(node.func.value))):
            found.append((node.lineno, f"matches a class name with .{node.func.attr}()"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "hasattr":
                found.append((node.lineno, "hasattr(): declare the attribute or method instead"))
            elif node.func.id == "isinstance" and len(node.args) == 2 and any(
                    isinstance(n, ast.Name | ast.Attribute) and _KIND_NAME.search(
                        n.id if isinstance(n, ast.Name) else n.attr)
                    for n in ast.walk(node.args[1])):
                found.append((node.lineno, "isinstance() against a logger / data module class"))
    return found


@pytest.mark.parametrize("snippet", [
    'online = cfg.data._target_.endswith("OnlineDataModule")',
    'offline = not cfg["data"]["_target_"].endswith("OnlineDataModule")',
    'ok = cfg.logger.get("_target_") == "lightning.pytorch.loggers.WandbLogger"',
    'ok = type(logger).__name__ == "WandbLogger"',
    'ok = logger.__class__.__name__.startswith("Wandb")',
    'ok = type(data) is OnlineDataModule',
    'ok = "WandbLogger" in str(type(logger))',
    'ok = hasattr(trainer.checkpoint_callback, "target_identity")',
    'ok = hasattr(logger, "log_image")',
    'ok = isinstance(logger, WandbLogger)',
    'ok = isinstance(data, (dm.OfflineDataModule, dm.OnlineDataModule))',
])
def test_the_checker_catches_each_spelling_of_a_sniff(snippet):
    assert sniffing(snippet), f"not caught: {snippet}"


@pytest.mark.parametrize("snippet", [
    'if __name__ == "__main__":\n    main()',
    'gguf = path.endswith(".gguf")',
    'logger = instantiate(cfg.logger) if cfg.logger.get("_target_") else None',
    'cls = get_class(cfg.data._target_)',
    'raise ValueError(f"{name!r} is not a BlockDataModule subclass")',
    'ok = isinstance(callback, RunEndCallback)',
    'ok = isinstance(v, (int, float))',
])
def test_the_checker_leaves_legitimate_uses_alone(snippet):
    assert not sniffing(snippet), f"flagged: {snippet} ({sniffing(snippet)})"


def test_entry_code_does_not_sniff_types_or_names():
    files = entry_files()
    entries = {"dflash_lab/train/run.py", "dflash_lab/commands.py", "dflash_lab/export/cli.py"}
    assert entries <= set(files)
    problems = []
    for rel in files:
        lines = (REPO / rel).read_text().splitlines()
        for line, what in sniffing((REPO / rel).read_text()):
            text = lines[line - 1].strip()
            if (rel, text) not in ALLOWED:
                problems.append(f"{rel}:{line}: {what}: {text}")
    assert not problems, (
        "type or name sniffing in entry code (issue 28 item 4):\n  " + "\n  ".join(problems)
        + "\nDeclare what the run needs on the class (dflash_lab/data/module.py BlockDataModule; "
        "a config key, or a classmethod of hydra.utils.get_class(cfg.X._target_)) and put "
        "logger-specific work in a callback (dflash_lab/train/callbacks.py WandbRun); or, for a "
        "use that is no sniff, add it to ALLOWED in this file with the reason")


def test_allowed_uses_are_still_there():
    """An allowance outlives its use only by mistake."""
    for rel, text in ALLOWED:
        assert text in (REPO / rel).read_text(), f"{rel}: allowed {text!r} is gone; remove it"
