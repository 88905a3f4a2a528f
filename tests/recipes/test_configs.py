"""Every entry point's config composes with every option of every group it uses, and dflash-train
with every recipe (the shape of lightning-hydra-template's tests/test_configs.py): each config
resolves, every ``_target_`` imports, and the cheap parts instantiate (targets are the tiny one
or config-only stand-ins; no big model is ever loaded).

Entry points' groups come from their defaults lists (conf/<entry>.yaml), options from conf/<group>/
and recipes from recipes/: a new option, group or recipe is picked up without editing this file,
and a new group without an instantiation check below fails until it gets one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf, open_dict

from dflash_lab.entry import make_logger
from dflash_lab.paths import CONF_DIR, RECIPES_DIR
from dflash_lab.targets.target import TargetPieces
from dflash_lab.train.module import DFlashModule
from tests.export_doubles import write_checkpoint
from tests.stand_ins import config_target

ENTRY_POINTS = ("train", "capture", "regenerate", "eval")


def entry_groups(entry: str) -> dict[str, str]:
    """{group: package} of the config groups in conf/<entry>.yaml's defaults list."""
    groups = {}
    for item in yaml.safe_load((CONF_DIR / f"{entry}.yaml").read_text())["defaults"]:
        if isinstance(item, dict):
            (key, _), = item.items()
            if not key.startswith("override "):
                group, _, package = key.partition("@")
                groups[group] = package or group
    return groups


def group_options(group: str) -> list[str]:
    root = RECIPES_DIR if group == "recipe" else CONF_DIR / group
    return sorted(p.stem for p in root.glob("*.yaml"))


CASES = [(entry, group, option) for entry in ENTRY_POINTS for group in entry_groups(entry)
         for option in group_options(group)]


def compose_entry(entry: str, overrides: list[str], tmp_path, tiny_target_dir):
    """Compose, fill every ``???`` (target.name_or_path: the tiny target; others: paths under
    tmp_path), resolve all interpolations (``${hydra:...}`` included) and return the config."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=entry, overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    for key in missing_keys(OmegaConf.to_container(cfg, resolve=False)):
        value = tiny_target_dir if key == "target.name_or_path" else tmp_path / key
        OmegaConf.update(cfg, key, str(value))
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    return cfg


def missing_keys(node, prefix: str = "") -> list[str]:
    """Dotted keys of the ``???`` values of an unresolved config (OmegaConf.missing_keys
    resolves interpolations first, and ``${output_dir}`` to a ``???`` would raise)."""
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in missing_keys(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if node == "???" else []


def targets_in(node) -> list[str]:
    """Every non-null ``_target_`` in a resolved config (nested nodes included)."""
    if isinstance(node, dict):
        own = [node["_target_"]] if node.get("_target_") else []
        return own + [t for v in node.values() for t in targets_in(v)]
    if isinstance(node, list):
        return [t for v in node for t in targets_in(v)]
    return []


@pytest.mark.parametrize(("entry", "group", "option"), CASES)
def test_every_entry_point_group_option_composes_and_instantiates(
        entry, group, option, tiny_target_dir, big_target_dir, tmp_path):
    key = f"{group}@{entry_groups(entry)[group]}" if entry_groups(entry)[group] != group \
        else group
    cfg = compose_entry(entry, [f"{key}={option}"], tmp_path, tiny_target_dir)
    for target in targets_in(OmegaConf.to_container(cfg, resolve=True)):
        assert get_object(target) is not None, target
    cfg.paths.output_dir = str(tmp_path / "out")  # loggers and runs write under tmp_path
    check = CHECKS.get(group)
    if check is None:
        pytest.fail(f"group {group!r} of conf/{entry}.yaml has no instantiation check in "
                    "tests/recipes/test_configs.py::CHECKS; add one")
    check(cfg, entry_groups(entry)[group], tiny_target_dir=tiny_target_dir,
          big_target_dir=big_target_dir, tmp_path=tmp_path)


def test_entry_points_share_the_train_groups():
    """One config system: target and logger as dflash-train; one conversations group; eval's
    own datasets (eval_data, placed at data)."""
    train = set(entry_groups("train"))
    for entry in ("capture", "regenerate", "eval"):
        own = {"conversations"} | ({"eval_data"} if entry == "eval" else set())
        own |= {"server"} if entry in ("capture", "regenerate", "eval") else set()
        assert {"target", "logger"} <= set(entry_groups(entry)) <= train | own
    for entry in ("capture", "regenerate"):
        assert entry_groups(entry)["conversations"] == "data"


def test_settings_dataclasses_are_all_configurable():
    """Every field of the settings the entry points build from a config block has a key there
    (Hydra refuses an override of a key the YAML lacks, so a missing one is unreachable)."""
    from dataclasses import fields

    from dflash_lab.data.capture_loop import CaptureSettings
    from dflash_lab.data.regenerate_loop import RegenerateSettings
    from dflash_lab.serving.settings import ServerSettings

    block = yaml.safe_load((CONF_DIR / "regenerate.yaml").read_text())["regenerate"]
    server = yaml.safe_load((CONF_DIR / "server" / "default.yaml").read_text())
    for cls, keys in ((RegenerateSettings, block["settings"]), (ServerSettings, server)):
        assert {f.name for f in fields(cls)} == set(keys), cls.__name__
    assert "server" not in block  # one server group, shared with dflash-eval
    capture = yaml.safe_load((CONF_DIR / "capture.yaml").read_text())["capture"]
    assert {f.name for f in fields(CaptureSettings)} <= set(capture)  # + num_layers, progress


def test_paper_recipe_values():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["recipe=qwen3_8b_b16"])
    assert list(cfg.drafter.target_layer_ids) == [1, 9, 17, 25, 33]
    assert cfg.drafter.block_size == 16 and cfg.drafter.num_hidden_layers == 5
    assert cfg.module.optimizer.lr == 6e-4 and cfg.module.gamma == 7.0
    assert cfg.module.num_anchors == 512 and cfg.trainer.max_epochs == 6


# ------------------------------------------------------------------ per-group checks
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


def check_target(cfg, package, *, tiny_target_dir, **_):
    """The tiny target in its cached directory; target=hf loads the same directory."""
    if cfg.target._target_.endswith("load_tiny_target"):
        cfg.target.path = str(tiny_target_dir)
    target = instantiate(cfg.target)
    assert target.num_hidden_layers == 8


def check_logger(cfg, package, **_):
    logger = make_logger(cfg.logger)
    assert (logger is None) == (cfg.logger._target_ is None)


def check_server(cfg, package, **_):
    from dflash_lab.serving.settings import server_settings

    assert server_settings(cfg[package]).url.startswith("http")


def check_conversations(cfg, package, *, tmp_path, **_):
    data = instantiate(cfg[package], path="demo", demo_rows=3,
                       demo_file=str(tmp_path / "demo.jsonl"))
    assert len(data.dataset) == 3 and data.source["path"] == str(tmp_path / "demo.jsonl")


def _tiny_drafter(cfg, tiny_target_dir):
    return instantiate(cfg.drafter, _partial_=True)(
        target=config_target(tiny_target_dir), num_hidden_layers=1, target_layer_ids=[1, 3])


def _dummy_head(cfg):
    return TargetPieces(torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                        torch.nn.Identity(), torch.nn.Linear(cfg.hidden_size, cfg.vocab_size))


def _instantiate_train_rest(cfg, drafter):
    """Module (with its optimizer and scheduler partials), callbacks, logger and trainer."""
    online = cfg.data._target_.endswith("OnlineDataModule")  # the batches carry the target's
    held = {"last_hidden": online, "topk": 0}  # last hidden state (OnlineDataModule's answer)
    module = instantiate(cfg.module, drafter=drafter, target_head=_dummy_head(drafter.config),
                         target_distribution=held)
    assert isinstance(module, DFlashModule)
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    trainer_cfg = dict(cfg.trainer)
    if trainer_cfg.get("accelerator") == "gpu" and not torch.cuda.is_available():
        # GPU options are composed in full and built on CPU; an FSDP strategy object is built
        # on its own (Lightning refuses FSDP on a CPU accelerator).
        trainer_cfg["accelerator"] = "cpu"
        if hasattr(trainer_cfg.get("strategy"), "get"):
            assert instantiate(trainer_cfg["strategy"]) is not None
            trainer_cfg["strategy"] = "auto"
    trainer = instantiate(trainer_cfg, logger=make_logger(cfg.logger) or False,
                          callbacks=callbacks)
    assert trainer is not None
    opt = module.optimizer_factory(list(drafter.parameters()))
    module.scheduler_factory(opt, total_steps=10)
    return opt


def check_train_part(cfg, package, *, tiny_target_dir, **_):
    """drafter, module, trainer, callbacks, paths: the whole trainer side on the tiny shape. An
    option that leaves its head's own fields null (LiLiCorr: no engine defaults them) is refused
    naming the first; its tiny recipe's values complete it."""
    try:
        drafter = _tiny_drafter(cfg, tiny_target_dir)
    except ValueError as err:
        head = cfg.drafter.variant
        unset = [k for k, v in cfg.drafter.items() if v is None and k.startswith(f"{head}_")]
        assert unset and f"invalid {unset[0]}=None" in str(err), err
        recipe = yaml.safe_load((RECIPES_DIR / f"tiny_cpu_{head}.yaml").read_text())
        for key in unset:
            cfg.drafter[key] = recipe["drafter"][key]
        drafter = _tiny_drafter(cfg, tiny_target_dir)
    _instantiate_train_rest(cfg, drafter)


def check_data(cfg, package, *, tiny_target_dir, tmp_path, **_):
    """Online and offline data modules build (they read nothing before setup)."""
    data = instantiate(cfg.data, _partial_=True)(target=None, target_layer_ids=[1, 3])
    assert data.batch_size == cfg.data.batch_size


def _stand_in_source(cfg, target, path: Path) -> str:
    """A warm-start recipe's ``drafter.init_from``: a fresh drafter of the recipe's own values
    saved as our checkpoint (the real source is another run's output)."""
    fresh = instantiate(cfg.drafter, _partial_=True, init_from=None)(target=target)
    write_checkpoint(path, fresh.config, fresh.state_dict())
    return str(path)


def check_recipe(cfg, package, *, tiny_target_dir, big_target_dir, tmp_path, **_):
    """A recipe's drafter on a stand-in of its target's shape, then the trainer side."""
    tiny = cfg.target._target_.endswith("load_tiny_target")
    target_path = str(tiny_target_dir if tiny else big_target_dir)
    if cfg.drafter.get("init_from"):
        cfg.drafter.init_from = _stand_in_source(cfg, config_target(target_path),
                                                 tmp_path / "source.ckpt")
    extra = {"mask_token_id": 7} if cfg.drafter.mask_token_id is None and not tiny else {}
    drafter = instantiate(cfg.drafter, _partial_=True)(target=config_target(target_path), **extra)
    assert drafter.config.num_hidden_layers == cfg.drafter.num_hidden_layers
    if cfg.drafter.layer_types is not None:
        assert drafter.config.layer_types == list(cfg.drafter.layer_types)
    opt = _instantiate_train_rest(cfg, drafter)
    # Every recipe keeps the fused AdamW of conf/module/default.yaml (one kernel per step).
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True


def check_eval_data(cfg, package, **_):
    """An eval dataset option: a file path, or a reference dataset's hub id, split, text field
    and a prompt format that takes it, with the reference budget."""
    from dflash_lab.eval.long_prompts import context_targets
    from dflash_lab.eval.suite import check_long_fits, data_configs, is_long, is_reference

    (d,) = data_configs(cfg)
    if is_reference(d):
        assert d.hub_id and d.split and d.field and d.max_new_tokens == 2048
        assert d.shuffle_seed == 42 and "x" in d.prompt_format.format(prompt="x")
    elif is_long(d):  # a long-context set: valid lengths that fit SmolLM2's 8192 positions
        assert len(context_targets(4, d.min_context, d.max_context, d.spacing)) == 4
        check_long_fits(d, d.max_new_tokens, 8192)
        assert cfg.max_new_tokens == d.max_new_tokens
    else:
        assert d.path and cfg.max_new_tokens == d.max_new_tokens


CHECKS = {"target": check_target, "logger": check_logger, "conversations": check_conversations,
          "server": check_server,
          "eval_data": check_eval_data, "data": check_data, "recipe": check_recipe, **dict.fromkeys(
              ("drafter", "module", "trainer", "callbacks", "paths"), check_train_part)}


def test_one_server_group_for_regenerate_and_eval():
    """dflash-regenerate and dflash-eval compose the same ``server`` group: one override name
    (server.url=...) reaches both, and each builds the one ServerSettings from it."""
    from dflash_lab.serving.settings import ServerSettings, server_settings

    got = {}
    for name in ("regenerate", "eval"):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=name, overrides=["server.url=http://h:9/v1",
                                                       "server.retries=5"])
        got[name] = server_settings(cfg.server)
    assert got["regenerate"] == got["eval"] == ServerSettings(url="http://h:9/v1", retries=5)
    with pytest.raises(ValueError, match=r"server.nope is not a server option"):
        server_settings({"nope": 1})
