"""The SGLang release the exporter is right for has one definition
(export/engines/sglang.py DEFAULT_RELEASE): the export config's null means it, the
rule sets are named by it, and the copies other programs need (the Makefile's venv pin) equal it."""

import re

from dflash_lab.export.engines import RULE_SETS
from dflash_lab.export.engines.sglang import DEFAULT_RELEASE
from dflash_lab.export.options import EXPORT_OPTIONS, export_kwargs
from dflash_lab.paths import CONF_DIR, REPO_ROOT


def test_the_export_configs_null_is_the_default_release():
    train_yaml = (CONF_DIR / "train.yaml").read_text()
    assert re.search(r"^\s+sglang_version: null\b", train_yaml, re.M)
    assert export_kwargs({"sglang_version": None})["sglang_version"] == DEFAULT_RELEASE
    assert {o.key: o.default for o in EXPORT_OPTIONS}["sglang_version"] == DEFAULT_RELEASE


def test_the_rule_sets_and_the_sglang_venv_pin_the_same_release():
    assert any(r.name.startswith(f"sglang=={DEFAULT_RELEASE}") for r in RULE_SETS)
    pin = re.search(r"^SGLANG_VERSION \?= (\S+)$", (REPO_ROOT / "Makefile").read_text(), re.M)
    assert pin and pin.group(1) == DEFAULT_RELEASE, (
        "Makefile SGLANG_VERSION must equal export/engines/sglang.py DEFAULT_RELEASE")
