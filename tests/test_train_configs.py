"""Every recipe and every config group option composes and instantiates."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from stand_ins import config_target

from dflash_lab.paths import CONF_DIR, RECIPES_DIR
from dflash_lab.target.loader import TargetPieces
from dflash_lab.train.module import DFlashModule

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
GROUPS = {g: sorted(p.stem for p in (CONF_DIR / g).glob("*.yaml"))
          for g in ("target", "drafter", "data", "module", "trainer", "logger", "callbacks",
                    "paths")}


def _compose(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides, return_hydra_config=False)


@pytest.fixture(scope="module")
def big_target_dir(tmp_path_factory):
    """A stand-in for large targets: their depth and vocab, a tiny width (no weights needed)."""
    path = tmp_path_factory.mktemp("big_target")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "num_hidden_layers": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "intermediate_size": 64, "vocab_size": 262_144, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "max_position_embeddings": 40960}))
    return path


def _dummy_head(cfg):
    return TargetPieces(torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                        torch.nn.Identity(), torch.nn.Linear(cfg.hidden_size, cfg.vocab_size))


def _instantiate_rest(cfg, drafter, tmp_path):
    module = instantiate(cfg.module, drafter=drafter, target_head=_dummy_head(drafter.config))
    assert isinstance(module, DFlashModule)
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    logger = instantiate(cfg.logger) if cfg.logger.get("_target_") else False
    trainer_cfg = dict(cfg.trainer)
    if trainer_cfg.get("accelerator") == "gpu" and not torch.cuda.is_available():
        # GPU options are composed in full and built on CPU; an FSDP strategy object is built
        # on its own (Lightning refuses FSDP on a CPU accelerator).
        trainer_cfg["accelerator"] = "cpu"
        if hasattr(trainer_cfg.get("strategy"), "get"):
            assert instantiate(trainer_cfg["strategy"]) is not None
            trainer_cfg["strategy"] = "auto"
    trainer = instantiate(trainer_cfg, logger=logger, callbacks=callbacks)
    assert trainer is not None
    opt = module.optimizer_factory(list(drafter.parameters()))
    module.scheduler_factory(opt, total_steps=10)
    return opt


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_instantiates(recipe, big_target_dir, tiny_target_dir,
                                                tmp_path):
    overrides = [f"recipe={recipe}", f"paths.output_dir={tmp_path}"]
    cfg = _compose(overrides)
    tiny = cfg.target._target_.endswith("load_tiny_target")
    target_path = str(tiny_target_dir if tiny else big_target_dir)
    extra = {"mask_token_id": 7} if cfg.drafter.mask_token_id is None and not tiny else {}
    drafter = instantiate(cfg.drafter, _partial_=True)(target=config_target(target_path), **extra)
    assert drafter.config.num_hidden_layers == cfg.drafter.num_hidden_layers
    if cfg.drafter.layer_types is not None:
        assert drafter.config.layer_types == list(cfg.drafter.layer_types)
    opt = _instantiate_rest(cfg, drafter, tmp_path)
    # Every recipe keeps the fused AdamW of conf/module/default.yaml (one kernel per step).
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True


def test_paper_recipe_values():
    cfg = _compose(["recipe=qwen3_8b_b16"])
    assert list(cfg.drafter.target_layer_ids) == [1, 9, 17, 25, 33]
    assert cfg.drafter.block_size == 16 and cfg.drafter.num_hidden_layers == 5
    assert cfg.module.optimizer.lr == 6e-4 and cfg.module.gamma == 7.0
    assert cfg.module.num_anchors == 512 and cfg.trainer.max_epochs == 6


@pytest.mark.parametrize(("group", "option"),
                         [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes_and_instantiates(group, option, tiny_target_dir, tmp_path):
    cfg = _compose([f"{group}={option}", f"paths.output_dir={tmp_path}"])
    if group == "target":
        key = "path" if option == "tiny" else "name_or_path"
        cfg = _compose([f"{group}={option}", f"paths.output_dir={tmp_path}",
                        f"target.{key}={tiny_target_dir}"]
                       + (["target.dtype=float32", "target.device=cpu"] if option != "tiny"
                          else []))
        target = instantiate(cfg.target)
        assert target.num_hidden_layers == 8
        return
    drafter = instantiate(cfg.drafter, _partial_=True)(target=config_target(tiny_target_dir),
                                                      num_hidden_layers=1,
                          target_layer_ids=[1, 3])
    if group == "data":
        kw = {"target": None, "target_layer_ids": [1, 3]}
        if option == "offline":
            data = instantiate(cfg.data, path=str(tmp_path / "capture"), **kw)
        else:
            data = instantiate(cfg.data, conversations=str(tmp_path / "c.jsonl"), **kw)
        assert data.batch_size == cfg.data.batch_size
        return
    _instantiate_rest(cfg, drafter, tmp_path)
