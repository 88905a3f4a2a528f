"""The stage commands' console entries (pyproject ``[project.scripts]``): each runs its stage
alone, or with ``recipe=NAME`` that stage of the recipe's pipeline (:func:`dflash_lab.pipeline.
stage_main`: the same folders, record and skip as ``dflash-lab run``). Each first calls
:func:`dflash_lab.terminal.setup` (not for library users of the stage modules). The top of the
import graph: only this file imports the orchestrator, and only when a recipe is named (the
exporter's command stays importable without Hydra)."""

from __future__ import annotations

import sys

from dflash_lab.terminal import setup


def _recipe_stage(stage: str, argv: list[str]) -> int:
    from dflash_lab.pipeline import stage_main

    return stage_main(stage, argv)


def _setup(stage: str) -> None:
    """:func:`setup`, then with ``recipe=NAME`` run that stage of the recipe and exit."""
    setup()
    if any(a.startswith("recipe=") for a in sys.argv[1:]):
        sys.exit(_recipe_stage(stage, sys.argv[1:]))


def capture() -> None:
    """``dflash-capture``."""
    _setup("capture")
    from dflash_lab.capture import main

    main()


def regenerate() -> None:
    """``dflash-regenerate``."""
    _setup("regenerate")
    from dflash_lab.regenerate import main

    main()


def evaluate() -> None:
    """``dflash-eval``."""
    _setup("eval")
    from dflash_lab.eval.cli import main

    main()


def export(argv: list[str] | None = None) -> int:
    """``dflash-export``: ``recipe=NAME`` without SOURCE and OUT_DIR (or --inspect) is the
    recipe's export stage; with paths, ``recipe=`` only supplies the recipe's export section."""
    from dflash_lab.export.cli import main, recipe_stage_only

    setup()
    argv = sys.argv[1:] if argv is None else list(argv)
    return _recipe_stage("export", argv) if recipe_stage_only(argv) else main(argv)
