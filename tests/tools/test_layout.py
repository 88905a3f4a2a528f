"""The package layout: every package is a folder under dflash_lab/, except the exporter, whose
source is the top-level export/ folder installed as dflash_lab.export (pyproject package-dir;
docs/architecture.md says why); pyproject's package list matches the folders; tests/ mirrors the
package (one folder per part, packages all); an install puts no folder on sys.path (a module
importable only from the repository root would break in a serving environment); and the
exporter imports without Lightning, Hydra, datasets or wandb."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: the package's size bound (issue 44: no larger than the 2026-12-06 package, 21.9k lines, with
#: every head and format added since inside it); lines of dflash_lab/ and export/ as
#: ``find dflash_lab export -name '*.py' | xargs cat | wc -l`` counts them
MAX_PACKAGE_LINES = 21_913
#: tests/ folders beside one per dflash_lab subpackage (docs/architecture.md, "Layout")
OTHER_TEST_FOLDERS = {"recipes", "tools"}


def test_the_exporter_stands_at_the_top_level():
    assert (REPO / "export" / "__init__.py").is_file()
    assert not (REPO / "dflash_lab" / "export").exists(), (
        "dflash_lab/export/ is back: the exporter's source is the top-level export/ folder")


def test_the_package_stays_inside_its_line_bound():
    lines = sum(len(p.read_bytes().splitlines()) for d in ("dflash_lab", "export")
                for p in (REPO / d).rglob("*.py"))
    assert lines <= MAX_PACKAGE_LINES, (
        f"dflash_lab/ + export/ hold {lines} lines, over the bound of {MAX_PACKAGE_LINES}: make "
        "room in the same change (docs/architecture.md, \"Add a head\": a head or a format is one "
        "module; delete what an interface makes redundant) rather than raising the bound")


def test_tests_mirror_the_package():
    tests = REPO / "tests"
    at_top = sorted(p.name for p in tests.glob("test_*.py"))
    assert not at_top, (
        f"test files at the top of tests/: {at_top}; move each into the folder of the part it "
        "tests (docs/architecture.md, Layout)")
    parts = {p.parent.name for p in (REPO / "dflash_lab").glob("*/__init__.py")} | {"export"}
    folders = {p.relative_to(tests).parts[0] for p in tests.glob("*/**/test_*.py")}
    assert folders <= parts | OTHER_TEST_FOLDERS, (
        f"tests/ folders {sorted(folders - parts - OTHER_TEST_FOLDERS)} mirror no package part: "
        f"use one of {sorted(parts | OTHER_TEST_FOLDERS)} (docs/architecture.md, Layout)")
    assert parts <= folders, f"dflash_lab parts without a tests/ folder: {sorted(parts - folders)}"
    no_init = sorted(str(d.relative_to(REPO)) for d in [tests, *(tests / f for f in folders)]
                     if not (d / "__init__.py").is_file())
    assert not no_init, (f"{no_init} lack __init__.py: tests/ and its folders are packages (the "
                         "doubles import as tests.doubles, and file names may repeat by folder)")


def package_folders() -> set[str]:
    """Every package on disk, named as installed (export/ is dflash_lab.export)."""
    inits = [*(REPO / "dflash_lab").rglob("__init__.py"), *(REPO / "export").rglob("__init__.py")]
    return {".".join(("dflash_lab", *parts) if parts[0] == "export" else parts)
            for parts in (i.parent.relative_to(REPO).parts for i in inits)}


def test_pyproject_lists_every_package_folder_and_maps_only_the_exporter():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"dflash_lab.export": "export"}
    assert set(setuptools["packages"]) == package_folders(), (
        "pyproject [tool.setuptools] packages must list every package folder of dflash_lab/ and "
        "export/ (export/X installs as dflash_lab.export.X)")


def _run_outside_repo(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter outside the repository (its root is not on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=env)


def test_the_installed_package_imports_outside_the_repository_and_adds_no_path(tmp_path):
    code = ("import importlib.util, dflash_lab.export, dflash_lab.export.engines; "
            "print(dflash_lab.export.__file__); print(importlib.util.find_spec('export'))")
    result = _run_outside_repo(code, tmp_path)
    assert result.returncode == 0, (
        f"dflash_lab.export does not import outside the repository: {result.stderr[-2000:]}; "
        "reinstall with `.venv/bin/pip install -c constraints.txt -e . --no-deps`")
    where, top_level = result.stdout.splitlines()
    assert Path(where).parts[-2:] == ("export", "__init__.py") and Path(where).parent.parent == REPO
    assert top_level == "None", (
        f"a top-level `export` module is importable outside the repository ({top_level}): the "
        "install puts the repository root on sys.path (editable 'compat' mode?) or another "
        "distribution ships `export`; reinstall with the default editable mode")


#: What a serving host may lack: importing any of them fails in the test below.
BLOCKED = ("lightning", "pytorch_lightning", "lightning_fabric", "hydra", "omegaconf", "datasets",
           "wandb")


def test_the_exporter_imports_with_lightning_hydra_datasets_and_wandb_blocked(tmp_path):
    """Every module of the exporter imports, and its CLI answers --help, while an import hook
    refuses the training stack (what a serving host does not install)."""
    modules = [".".join(("dflash_lab", *p.relative_to(REPO).with_suffix("").parts))
               .removesuffix(".__init__") for p in (REPO / "export").rglob("*.py")]
    code = f"""
import importlib, sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"blocked for this test: {{name}}")
sys.meta_path.insert(0, Blocker())
for name in {sorted(modules)!r}:
    importlib.import_module(name)
from dflash_lab.export.cli import main
try:
    main(["--help"])
except SystemExit as stop:
    assert stop.code == 0, stop.code
print("ok")
"""
    result = _run_outside_repo(code, tmp_path)
    assert result.returncode == 0 and result.stdout.rstrip().endswith("ok"), (
        f"the exporter needs one of {BLOCKED} to import: {result.stderr[-2000:]}; import it "
        "inside the function that needs it, or move that code out of export/")


#: an edit of the import path in code (prose that names ``sys.path`` is fine)
_PATH_EDIT = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend)\b|(\[[^\]]*\])?\s*[+]?=)")


def test_no_code_edits_the_import_path():
    """Drivers that import the repository's own folders run as modules from its root
    (``python -m scripts.NAME``; scripts/__init__.py), the package imports as installed: no file
    edits sys.path (issue 28)."""
    offenders = [f"{path.relative_to(REPO)}:{n}"
                 for folder in ("dflash_lab", "scripts", "benchmarks", "tests", "experiments")
                 for path in sorted((REPO / folder).rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if _PATH_EDIT.search(line)]
    assert not offenders, (
        f"import-path edits at {offenders}: run the file as a module from the repository root "
        "(`python -m scripts.NAME`, cwd=REPO_ROOT for a subprocess) instead")
