"""The package layout: every package is a folder under dflash_lab/ (the exporter too:
dflash_lab/export/, a plain subpackage, no package-dir mapping), found by pyproject's
packages.find; tests/ mirrors the package (one folder per part, packages all); and an install
puts no folder on sys.path (a module importable only from the repository root would break in a
serving environment)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: tests/ folders beside one per dflash_lab subpackage (docs/architecture.md, "Layout")
OTHER_TEST_FOLDERS = {"recipes", "tools"}


def test_the_exporter_is_a_plain_subpackage():
    assert (REPO / "dflash_lab" / "export" / "__init__.py").is_file()
    assert not (REPO / "export").exists(), (
        "a top-level export/ folder is back: the exporter lives in dflash_lab/export/")


def test_tests_mirror_the_package():
    tests = REPO / "tests"
    at_top = sorted(p.name for p in tests.glob("test_*.py"))
    assert not at_top, (
        f"test files at the top of tests/: {at_top}; move each into the folder of the part it "
        "tests (docs/architecture.md, Layout)")
    parts = {p.parent.name for p in (REPO / "dflash_lab").glob("*/__init__.py")}
    folders = {p.relative_to(tests).parts[0] for p in tests.glob("*/**/test_*.py")}
    assert folders <= parts | OTHER_TEST_FOLDERS, (
        f"tests/ folders {sorted(folders - parts - OTHER_TEST_FOLDERS)} mirror no package part: "
        f"use one of {sorted(parts | OTHER_TEST_FOLDERS)} (docs/architecture.md, Layout)")
    assert parts <= folders, f"dflash_lab parts without a tests/ folder: {sorted(parts - folders)}"
    no_init = sorted(str(d.relative_to(REPO)) for d in [tests, *(tests / f for f in folders)]
                     if not (d / "__init__.py").is_file())
    assert not no_init, (f"{no_init} lack __init__.py: tests/ and its folders are packages (the "
                         "doubles import as tests.doubles, and file names may repeat by folder)")


def test_pyproject_finds_every_package_folder_and_maps_none():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")
    from setuptools import find_packages

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in setuptools and "packages" in setuptools
    include = setuptools["packages"]["find"]["include"]
    found = set(find_packages(str(REPO), include=include))
    on_disk = {".".join(init.parent.relative_to(REPO).parts)
               for init in (REPO / "dflash_lab").rglob("__init__.py")}
    assert found == on_disk and "dflash_lab.export.engines" in found


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
    assert Path(where).parts[-3:] == ("dflash_lab", "export", "__init__.py")
    assert top_level == "None", (
        f"a top-level `export` module is importable outside the repository ({top_level}): the "
        "install puts the repository root on sys.path (editable 'compat' mode?) or another "
        "distribution ships `export`; reinstall with the default editable mode")


def test_exporter_imports_no_lightning_or_hydra(tmp_path):
    code = ("import sys, dflash_lab.export, dflash_lab.export.cli, dflash_lab.export.selfcheck, "
            "dflash_lab.export.peers; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('lightning', 'pytorch_lightning', 'lightning_fabric', 'hydra', 'omegaconf')))")
    result = _run_outside_repo(code, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", (
        f"importing the exporter pulls in {result.stdout.strip()}: it must stay importable "
        "without Lightning or Hydra (docs/export.md)")


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
