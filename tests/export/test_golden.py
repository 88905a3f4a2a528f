"""config.json golden files: what the exporter writes for each shipped recipe's layout.

Regenerate after an intended format change with ``DFLASH_UPDATE_GOLDEN=1 pytest
tests/export/test_golden.py`` and review the diff.
"""

import json
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.export import plan_export
from dflash_lab.export.api import OURS, format_config
from dflash_lab.paths import CONF_DIR, RECIPES_DIR
from dflash_lab.train.factory import drafter_config_for_target
from dflash_lab.train.warm_start import NOT_FIELDS
from tests.stand_ins import config_target

GOLDEN = Path(__file__).parent / "golden" / "export_config"
ALL_RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
#: Warm-started recipes (``drafter.init_from``) export their source's config, not one built from
#: the recipe: tests/train/test_warm_start.py and tests/recipes/test_recipes_run.py cover them.
WARM_STARTED = {r for r in ALL_RECIPES if "init_from:" in (RECIPES_DIR / f"{r}.yaml").read_text()}
RECIPES = [r for r in ALL_RECIPES if r not in WARM_STARTED]
# Stand-ins for each recipe's target: depth and vocab of the real model, a small width.
BIG = {"hidden_size": 64, "num_hidden_layers": 64, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
       "vocab_size": 262_144, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
       "max_position_embeddings": 40960}


def _recipe_config(recipe, tmp_path, tiny_target_dir):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"recipe={recipe}"])
    if cfg.target._target_.endswith("load_tiny_target"):
        target = tiny_target_dir
    else:
        target = tmp_path / "target"
        target.mkdir()
        (target / "config.json").write_text(json.dumps(BIG))
    fields = {k: v for k, v in cfg.drafter.items() if k not in NOT_FIELDS}
    if fields["mask_token_id"] is None and target != tiny_target_dir:
        fields["mask_token_id"] = 7
    return drafter_config_for_target(config_target(target), **fields), cfg


def test_only_the_warm_started_recipes_are_left_out():
    """The exclusion above is not a silent skip: it names exactly the init_from recipes."""
    assert sorted(WARM_STARTED) == ["finetune_cpu"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_exported_config_json_matches_the_golden_file(recipe, tmp_path, tiny_target_dir):
    config, cfg = _recipe_config(recipe, tmp_path, tiny_target_dir)
    # what the exporter writes (DSpark: vLLM's speculators layout, export/formats/dspark.py)
    got = format_config(OURS, config, "bfloat16", None, vocab_known=True)
    path = GOLDEN / f"{recipe}.json"
    if os.environ.get("DFLASH_UPDATE_GOLDEN") == "1":
        path.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    assert path.is_file(), f"no golden file {path}; run with DFLASH_UPDATE_GOLDEN=1"
    assert got == json.loads(path.read_text())


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_is_exportable_for_its_intended_engines(recipe, tmp_path, tiny_target_dir):
    config, cfg = _recipe_config(recipe, tmp_path, tiny_target_dir)
    engine = cfg.get("export", {}).get("engine", "both")
    if config.learned_mask_embedding or config.attention_sink_bias:
        engine = "vllm"  # SGLang < 0.5.23 drops these; 0.5.23 only on some draft backends
    from dflash_lab.export.api import parse_engines
    from dflash_lab.export.checks import refusals

    _, findings = plan_export(config, parse_engines(engine),
                              sglang_backend=cfg.export.sglang_attention_backend)
    assert not refusals(findings), [f.message for f in refusals(findings)]
