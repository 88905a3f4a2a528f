"""The package layout: the exporter's source is the top-level export/ folder, and it installs and
imports as ``dflash_lab.export`` (pyproject.toml's package-dir), never as a top-level ``export``;
tests/ mirrors the package (one folder per part, packages all).

Tests run from the repository root, where the folder itself is importable as ``export``: these
checks catch a stray ``from export...`` that only works there, a package folder missing from
pyproject's explicit list (it would be missing from the wheel), and an install that puts the
repository root on sys.path."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: folders holding the project's Python files (the venvs and outputs/ are not ours)
CODE_DIRS = ("dflash_lab", "export", "tests", "scripts", "benchmarks", "recipes")
TOP_LEVEL_EXPORT = re.compile(r"^\s*(from\s+export(\.|\s)|import\s+export\b)", re.MULTILINE)
#: tests/ folders beside one per dflash_lab subpackage (docs/architecture.md, "Layout")
OTHER_TEST_FOLDERS = {"export", "recipes", "tools"}


def _python_files() -> list[Path]:
    files = [p for d in CODE_DIRS for p in sorted((REPO / d).rglob("*.py"))]
    return files + sorted(REPO.glob("*.py"))


def test_no_module_imports_the_top_level_export_package():
    offenders = [f"{p.relative_to(REPO)}:{text[:m.start()].count(chr(10)) + 1}"
                 for p in _python_files()
                 for text in [p.read_text(encoding="utf-8")]
                 for m in TOP_LEVEL_EXPORT.finditer(text)]
    assert not offenders, (
        "these lines import the exporter as the top-level `export` package, which only exists "
        f"when the repository root is on sys.path: {offenders}; import dflash_lab.export instead")


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


def _declared_packages() -> tuple[list[str], dict[str, str]]:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return setuptools["packages"], setuptools["package-dir"]


def _package_folders(root: str, name: str) -> set[str]:
    """Dotted names of the packages (folders with __init__.py) under REPO/root, named name.*."""
    return {".".join([name, *init.parent.relative_to(REPO / root).parts])
            for init in (REPO / root).rglob("__init__.py")}


def test_pyproject_lists_every_package_folder():
    packages, package_dir = _declared_packages()
    assert package_dir == {"dflash_lab.export": "export"}
    on_disk = _package_folders("dflash_lab", "dflash_lab") | _package_folders("export",
                                                                              "dflash_lab.export")
    assert set(packages) == on_disk, (
        f"pyproject.toml [tool.setuptools] packages differs from the package folders: missing "
        f"{sorted(on_disk - set(packages))}, extra {sorted(set(packages) - on_disk)}; the list is "
        "explicit (packages.find does not follow package-dir), so add or remove those names")


def _run_outside_repo(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter outside the repository (its root is not on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=env)


def test_installed_package_maps_dflash_lab_export_and_no_top_level_export(tmp_path):
    code = ("import importlib.util, dflash_lab.export, dflash_lab.export.engines; "
            "print(dflash_lab.export.__file__); print(importlib.util.find_spec('export'))")
    result = _run_outside_repo(code, tmp_path)
    assert result.returncode == 0, (
        f"dflash_lab.export does not import outside the repository: {result.stderr[-2000:]}; "
        "reinstall with `.venv/bin/pip install -c constraints.txt -e . --no-deps`")
    where, top_level = result.stdout.splitlines()
    assert Path(where).parts[-2:] == ("export", "__init__.py")
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
