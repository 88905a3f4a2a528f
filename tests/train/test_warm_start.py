"""``drafter.init_from``: every source format we read starts a drafter with its trained weights
and config (train/warm_start.py, export/peers.py), and dflash-eval / dflash-export read the same
sources.

Sources are small checkpoints written the way each trainer writes them: ours by our code, z-lab
directories from z-lab's config keys and module names, speculators directories by speculators
0.9.0 itself (.venv-speculators, subprocess) and from its documented keys, SpecForge
``training_state.pt`` from its CheckpointManager's keys.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_lab.eval.loading import load_drafter
from dflash_lab.export import export_drafter
from dflash_lab.model.config import FULL, SLIDING, TRAINING_SPEC_KEY, DrafterConfig, LayerSpec
from dflash_lab.paths import REPO_ROOT
from dflash_lab.train.factory import build_drafter
from dflash_lab.train.warm_start import group_defaults
from tests.export_doubles import (
    muse_for,
    muse_state,
    random_state,
    write_checkpoint,
    write_muse_dir,
    write_zlab_dir,
)

SPEC_PYTHON = REPO_ROOT / ".venv-speculators" / "bin" / "python"
ZLAB_PYTHON = REPO_ROOT / ".venv-dflash" / "bin" / "python"
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
V2 = dict(variant="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8,
          selector_top_k=4)


def tiny_source_config(target, **kw) -> DrafterConfig:
    """A drafter config for the built-in tiny target (hidden 64, vocab 768, 8 layers)."""
    cfg = target.model.config
    base = dict(hidden_size=cfg.hidden_size, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=96,
                vocab_size=cfg.vocab_size, mask_token_id=target.token_id("<|mask|>"),
                num_target_layers=cfg.num_hidden_layers, target_layer_ids=[1, 3, 5],
                block_size=4, layer_types=[SLIDING, FULL], sliding_window=8)
    return DrafterConfig(**{**base, **kw})


def zlab_dict(config: DrafterConfig) -> dict:
    """z-lab's config.json: our serving keys without our training spec or causality flags."""
    d = config.to_dict()
    d.pop(TRAINING_SPEC_KEY)
    d.pop("is_causal", None)
    d["dflash_config"].pop("causal", None)
    return d


def warm(target, path, **overrides):
    """build_drafter as dflash-train calls it: the drafter group's values plus overrides."""
    fields = {**group_defaults(overrides.pop("variant", None)), **overrides}
    return build_drafter(target, backend="sdpa", init_from=str(path), **fields)


def qwen3_shape(target, **extra) -> dict:
    """``Qwen3Config`` keywords for tiny_source_config's sizes: what z-lab's and speculators' own
    code build their drafters from (plus ``extra``)."""
    cfg = target.model.config
    return {"hidden_size": cfg.hidden_size, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": 512, "rope_theta": 1e6,
            **extra}


#: What every peer script starts with: its imports and arguments, and ``save_random``, which
#: saves a drafter with seeded random weights (z-lab leaves some tensors uninitialised).
_PEER_PRELUDE = """
import json, sys
import torch
out, args = sys.argv[1], [json.loads(a) for a in sys.argv[2:]]

def save_random(model, path):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
"""


def run_peer_script(python: Path, code: str, out: Path, *args) -> str:
    """Run ``code``, a script that uses another trainer's own package, with ``python`` (that
    trainer's venv, offline, one thread), after _PEER_PRELUDE: ``out`` is ``out`` and ``args``
    the JSON of ``args``. Returns its stdout; a failure shows its stderr."""
    script = out / "peer_script.py"
    script.write_text(_PEER_PRELUDE + code)
    done = subprocess.run([str(python), str(script), str(out), *map(json.dumps, args)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def assert_same_weights(drafter, state: dict[str, torch.Tensor]) -> None:
    ours = drafter.state_dict()
    assert set(ours) == set(state)
    assert all(torch.equal(ours[k], state[k]) for k in state)


# ---------------------------------------------------------------------------- ours and z-lab
def test_our_checkpoint_run_dir_and_export_start_the_drafter(tiny_target, tmp_path):
    config = tiny_source_config(tiny_target, learned_mask_embedding=True)
    state = random_state(config)
    ckpt = write_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt", config, state)
    for path in (ckpt, tmp_path / "run"):
        drafter = warm(tiny_target, path)
        assert drafter.config.block_size == 4 and drafter.config.layer_types == [SLIDING, FULL]
        assert_same_weights(drafter, state)
    # the training module re-initialises a learned mask embedding from the target row; a
    # warm-started drafter keeps the trained one
    drafter.init_mask_embedding(tiny_target.pieces().embed_tokens)
    assert torch.equal(drafter.mask_embedding, state["mask_embedding"])
    export_drafter(ckpt, tmp_path / "export", engine="vllm", dtype="float32")
    assert_same_weights(warm(tiny_target, tmp_path / "export"), state)


@pytest.mark.parametrize("variant", ["dflash1", "dflash2"])
def test_zlab_directory_starts_the_drafter(tiny_target, tmp_path, variant):
    extra = V2 if variant == "dflash2" else {}
    config = tiny_source_config(tiny_target, layer_types=None, sliding_window=None, **extra)
    state = random_state(config)
    saved = {f"{k}.weight" if k in CODEBOOKS else k: v for k, v in state.items()}
    zdir = write_zlab_dir(tmp_path / "zlab", zlab_dict(config), saved)  # save_pretrained names
    drafter = warm(tiny_target, zdir)
    assert drafter.config.variant == variant and drafter.config.block_size == 4
    assert drafter.config.causal_flags == [False, False]  # z-lab: full layers bidirectional
    assert_same_weights(drafter, state)


def test_muse_glimmer_directory_starts_the_drafter(tiny_target, tmp_path):
    """A directory written by transformers' MuseGlimmerAssistantModel: the warm-started drafter
    holds its weights, takes the target's vocabulary (the format records none) and computes what
    the owners' forward computes on the same block and context (window not reached: 9 context
    positions + 4 slots <= W=16)."""
    pytest.importorskip("transformers.models.muse_glimmer_assistant")
    model = write_muse_dir(tmp_path / "muse", **muse_for(tiny_target))
    drafter = warm(tiny_target, tmp_path / "muse").eval()
    assert drafter.config.vocab_size == tiny_target.vocab_size != 202048
    assert drafter.config.layer_specs() == [LayerSpec(16, False)] * 2
    assert drafter.config.rope_theta == 500000.0 and drafter.config.rms_norm_eps == 1e-5
    assert_same_weights(drafter, muse_state(model))
    pieces, mask = tiny_target.pieces(), drafter.config.mask_token_id
    feats = torch.randn(1, 9, 3 * 64, generator=torch.Generator().manual_seed(3))
    cache = drafter.new_cache()
    drafter.extend_context(cache, feats)
    ours = drafter.draft(cache, torch.tensor([11]), pieces.embed_tokens)
    with torch.no_grad():
        theirs = model(noise_embeds=pieces.embed_tokens(torch.tensor([[11, mask, mask, mask]])),
                       context_hidden_states=feats,
                       position_ids=torch.arange(9 + 4)[None]).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pieces.lm_head(ours), pieces.lm_head(theirs), rtol=1e-5,
                               atol=1e-5)


_ZLAB_WRITER = """
from transformers import Qwen3Config
from dflash.model import DFlash2DraftModel, DFlashDraftModel
shape, v2 = args
for name, cls, extra in (("dflash1", DFlashDraftModel, {}), ("dflash2", DFlash2DraftModel, v2)):
    cfg = Qwen3Config(**shape, architectures=[cls.__name__])
    cfg.dflash_config = {**cfg.dflash_config, **extra}
    save_random(cls(cfg), f"{out}/{name}")
"""


@pytest.mark.skipif(not ZLAB_PYTHON.exists(),
                    reason="needs .venv-dflash (make dflash-venv): z-lab's dflash package")
@pytest.mark.slow
def test_zlab_directories_written_by_zlab_code_start_the_drafter(tiny_target, tmp_path):
    shape = qwen3_shape(tiny_target, num_target_layers=tiny_target.model.config.num_hidden_layers,
                        block_size=4,
                        dflash_config={"mask_token_id": tiny_target.token_id("<|mask|>"),
                                       "target_layer_ids": [1, 3, 5]})
    v2 = {k: v for k, v in V2.items() if k != "variant"}
    run_peer_script(ZLAB_PYTHON, _ZLAB_WRITER, tmp_path, shape, v2)
    for variant in ("dflash1", "dflash2"):
        saved = load_file(str(tmp_path / variant / "model.safetensors"))
        drafter = warm(tiny_target, tmp_path / variant)
        assert drafter.config.variant == variant and drafter.config.block_size == 4
        ours = drafter.state_dict()
        assert len(ours) == len(saved)
        assert all(torch.equal(ours[k], saved[f"{k}.weight" if k in CODEBOOKS else k])
                   for k in ours)


# ---------------------------------------------------------------------------- speculators
def speculators_dict(config: DrafterConfig, non_causal: bool | None = None) -> dict:
    """speculators 0.9.0's config.json (DFlashSpeculatorConfig.save_pretrained) for ``config``."""
    tl = {"model_type": "qwen3", "hidden_size": config.hidden_size,
          "num_hidden_layers": config.num_hidden_layers,
          "num_attention_heads": config.num_attention_heads,
          "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
          "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
          "rms_norm_eps": config.rms_norm_eps, "attention_bias": False,
          "max_position_embeddings": config.max_position_embeddings,
          "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
          "layer_types": list(config.layer_types), "use_sliding_window": config.any_sliding,
          "sliding_window": config.sliding_window}
    kind = "dflash2" if config.variant == "dflash2" else "dflash"
    d = {"architectures": ["DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel"],
         "speculators_model_type": kind, "speculators_version": "0.9.0",
         "transformer_layer_config": tl, "draft_vocab_size": config.vocab_size,
         "block_size": config.block_size, "target_hidden_size": None,
         "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
         "mask_token_id": config.mask_token_id, "sample_from_anchor": False,
         "speculators_config": {"algorithm": kind}}
    if non_causal is not None:
        d["sliding_window_non_causal"] = non_causal
    if config.variant == "dflash2":
        d.update({k: getattr(config, k) for k in
                  ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")})
    return d


def write_speculators_dir(path: Path, d: dict, state: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(d))
    hidden = d["transformer_layer_config"]["hidden_size"]
    # what save_pretrained writes besides the drafter: the verifier-owned tensors it keeps
    extra = {"embed_tokens.weight": torch.zeros(4, hidden), "verifier_norm.weight": torch.ones(4)}
    save_file({**state, **extra}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize(("variant", "non_causal", "causal"), [
    ("dflash1", None, [True, False]), ("dflash1", True, [False, False]),
    ("dflash2", None, [False, False]),  # speculators' dflash2 default: non-causal sliding
])
def test_speculators_directory_from_its_documented_keys(tiny_target, tmp_path, variant,
                                                        non_causal, causal):
    config = tiny_source_config(tiny_target, **(V2 if variant == "dflash2" else {}))
    state = random_state(config)
    sdir = write_speculators_dir(tmp_path / "spec", speculators_dict(config, non_causal), state)
    drafter = warm(tiny_target, sdir)
    assert drafter.config.variant == variant
    assert drafter.config.target_layer_ids == [1, 3, 5]  # aux ids [2, 4, 6] minus one
    assert drafter.config.causal_flags == causal  # full layers always bidirectional
    assert drafter.config.layer_specs()[0].window == 9  # speculators' 8 + 1
    assert_same_weights(drafter, state)
    loaded = load_drafter(sdir)  # dflash-eval
    assert loaded.drafter.config.target_layer_ids == [1, 3, 5]
    out = export_drafter(sdir, tmp_path / "export", engine="vllm", dtype="float32").out_dir
    exported = json.loads((Path(out) / "config.json").read_text())  # dflash-export: z-lab ids
    assert exported["dflash_config"]["target_layer_ids"] == [1, 3, 5]


def test_a_speculators_sample_from_anchor_directory_is_read_with_it(tiny_target, tmp_path):
    """speculators' ``sample_from_anchor: true`` (slot k predicts anchor + k + 1) is read, not
    refused: the warm start, dflash-eval and the export keep it."""
    config = tiny_source_config(tiny_target)
    state = random_state(config)
    d = {**speculators_dict(config), "sample_from_anchor": True}
    sdir = write_speculators_dir(tmp_path / "spec", d, state)
    drafter = warm(tiny_target, sdir)
    assert drafter.config.sample_from_anchor and drafter.config.num_draft_tokens == 4
    assert_same_weights(drafter, state)
    assert load_drafter(sdir).drafter.config.sample_from_anchor
    assert not warm(tiny_target, write_speculators_dir(
        tmp_path / "plain", speculators_dict(config), state)).config.sample_from_anchor
    v2 = tiny_source_config(tiny_target, **V2)
    d2 = {**speculators_dict(v2), "sample_from_anchor": True}
    with pytest.raises(ValueError, match="sample_from_anchor.*variant='dflash2'"):
        warm(tiny_target, write_speculators_dir(tmp_path / "v2", d2, random_state(v2)))


def test_a_speculators_draft_vocabulary_reads_back_with_its_head_and_maps(tiny_target, tmp_path):
    """speculators' reduced draft vocabulary: its lm_head [N, H], d2t offsets and t2d are the
    drafter's (they are the verifier's only without one); a broken map is refused."""
    config = tiny_source_config(tiny_target)
    ids = torch.arange(0, config.vocab_size, 3)[:100]
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    state = {**random_state(config), "lm_head.weight": torch.randn(100, config.hidden_size),
             "d2t": ids - torch.arange(100), "t2d": t2d}
    d = {**speculators_dict(config), "draft_vocab_size": 100}
    drafter = warm(tiny_target, write_speculators_dir(tmp_path / "spec", d, state))
    assert drafter.config.draft_vocab_size == 100 and drafter.draft_vocab_set
    assert torch.equal(drafter.draft_token_ids(), ids)
    assert torch.equal(drafter.lm_head.weight, state["lm_head.weight"])
    broken = {**state, "d2t": torch.zeros(100, dtype=torch.long)}
    with pytest.raises(ValueError, match="d2t and t2d do not name the same 100"):
        warm(tiny_target, write_speculators_dir(tmp_path / "bad", d, broken))


@pytest.mark.parametrize(("key", "value", "message"), [
    ("aux_hidden_state_layer_ids", [0, 2, 4], r"aux_hidden_state_layer_ids=\[0, 2, 4\]"),
    ("mask_token_id", None, "mask_token_id is null"),
])
def test_speculators_features_we_cannot_run_are_refused(tiny_target, tmp_path, key, value,
                                                        message):
    config = tiny_source_config(tiny_target)
    d = {**speculators_dict(config), key: value}
    sdir = write_speculators_dir(tmp_path / "spec", d, random_state(config))
    with pytest.raises(ValueError, match=message) as err:
        warm(tiny_target, sdir)
    assert str(sdir) in str(err.value)


_SPEC_WRITER = """
from transformers import Qwen3Config
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
shape, extra = args
for kind, model_cls, cfg_cls in (("dflash", DFlashDraftModel, DFlashSpeculatorConfig),
                                 ("dflash2", DFlash2DraftModel, DFlash2SpeculatorConfig)):
    block = extra["block_size"]
    spec = SpeculatorsConfig(algorithm=kind, default_proposal_method="greedy",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block - 1)],
        verifier=VerifierConfig(name_or_path="tiny", architectures=["Qwen3ForCausalLM"]))
    v2 = extra["dflash2"] if kind == "dflash2" else {}
    cfg = cfg_cls(transformer_layer_config=Qwen3Config(**shape),
                  draft_vocab_size=shape["vocab_size"], speculators_config=spec,
                  **extra["common"], **v2)
    save_random(model_cls(cfg), f"{out}/{kind}")
"""


@pytest.mark.skipif(not SPEC_PYTHON.exists(),
                    reason="needs .venv-speculators (make speculators-venv): speculators 0.9.0")
@pytest.mark.slow
def test_speculators_directories_written_by_speculators(tiny_target, tmp_path):
    shape = qwen3_shape(tiny_target, layer_types=[SLIDING, FULL], use_sliding_window=True,
                        sliding_window=8, max_window_layers=0)
    mask = tiny_target.token_id("<|mask|>")
    extra = {"block_size": 4, "common": {"block_size": 4, "mask_token_id": mask,
                                         "aux_hidden_state_layer_ids": [2, 4, 6]},
             "dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                         "selector_top_k": 4}}
    run_peer_script(SPEC_PYTHON, _SPEC_WRITER, tmp_path, shape, extra)
    for kind, causal in (("dflash", [True, False]), ("dflash2", [False, False])):
        saved = load_file(str(tmp_path / kind / "model.safetensors"))
        drafter = warm(tiny_target, tmp_path / kind)
        assert drafter.config.target_layer_ids == [1, 3, 5]
        assert drafter.config.causal_flags == causal  # dflash2: sliding_window_non_causal
        assert (drafter.config.variant == "dflash2") == (kind == "dflash2")
        assert drafter.config.layer_specs()[0].window == 9  # speculators' 8, block-anchored
        ours = drafter.state_dict()
        assert all(torch.equal(ours[k], saved[k]) for k in ours)
        assert set(saved) - set(ours) <= {"embed_tokens.weight", "lm_head.weight",
                                          "verifier_norm.weight", "t2d", "d2t"}


# ---------------------------------------------------------------------------- SpecForge
def write_specforge_run(run: Path, config: DrafterConfig, state: dict[str, torch.Tensor],
                        strategy: str = "dflash", with_config: bool = True) -> Path:
    """SpecForge's CheckpointManager layout: ``{run_id}-step{N}/training_state.pt`` and a
    ``{run_id}-latest`` link; the draft config JSON (--draft-model-config) copied beside."""
    step = run / "r1-step20"
    step.mkdir(parents=True)
    torch.save({"draft_state_dict": state, "global_step": 20, "epoch": 1, "strategy": strategy,
                "run_id": "r1", "world_size": 1,
                "replicated_optimizer_state": {"state": {}, "param_groups": []}},
               step / "training_state.pt")
    (run / "r1-latest").symlink_to(step.name)
    if with_config:
        (run / "config.json").write_text(json.dumps(zlab_dict(config)))
    return run


def test_specforge_checkpoint_starts_the_drafter(tiny_target, tmp_path):
    config = tiny_source_config(tiny_target)
    state = random_state(config)
    run = write_specforge_run(tmp_path / "sf", config, state)
    for path in (run, run / "r1-step20", run / "r1-step20" / "training_state.pt"):
        drafter = warm(tiny_target, path)
        assert drafter.config.causal_flags == [True, False]  # SpecForge's mask
        assert_same_weights(drafter, state)
    assert load_drafter(run).drafter.config.block_size == 4
    export_drafter(run, tmp_path / "export", engine="vllm", dtype="float32")


@pytest.mark.parametrize(("kw", "message"), [({"with_config": False}, "--draft-model-config"),
                                             ({"strategy": "dspark"}, "strategy 'dspark'")])
def test_specforge_checkpoints_we_cannot_read_are_refused(tiny_target, tmp_path, kw, message):
    config = tiny_source_config(tiny_target)
    run = write_specforge_run(tmp_path / "sf", config, random_state(config), **kw)
    with pytest.raises(ValueError, match=message):
        warm(tiny_target, run)


# ---------------------------------------------------------------------------- overrides
def test_overrides_that_contradict_the_weights_are_reported(tiny_target, tmp_path, caplog):
    config = tiny_source_config(tiny_target, is_causal=[True, False])
    ckpt = write_checkpoint(tmp_path / "a.ckpt", config, random_state(config))
    with caplog.at_level(logging.WARNING, logger="dflash_lab.train.warm_start"):
        drafter = warm(tiny_target, ckpt, layer_types=[FULL, FULL], is_causal=False,
                       block_size=8, target_layer_ids=[2, 4, 6])
    assert drafter.config.block_size == 8 and drafter.config.target_layer_ids == [2, 4, 6]
    text = " ".join(r.getMessage() for r in caplog.records)
    for change in ("layer 0: sliding -> full", "layer 0: causal -> bidirectional",
                   "block_size 4 -> 8", "target_layer_ids [1, 3, 5] -> [2, 4, 6]"):
        assert change in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash_lab.train.warm_start"):
        warm(tiny_target, ckpt)  # nothing overridden: nothing reported
    assert not caplog.records


def test_another_target_or_other_shapes_are_refused(tiny_target, tmp_path):
    config = tiny_source_config(tiny_target)
    other = dataclasses.replace(config, hidden_size=32, head_dim=8)
    ckpt = write_checkpoint(tmp_path / "other.ckpt", other, random_state(other))
    with pytest.raises(ValueError, match="hidden_size=32 but the target has hidden_size=64") \
            as err:
        warm(tiny_target, ckpt)
    assert str(ckpt) in str(err.value)
    small = dataclasses.replace(config, vocab_size=500)
    ckpt = write_checkpoint(tmp_path / "vocab.ckpt", small, random_state(small))
    with pytest.raises(ValueError, match="vocab_size=500 but the target has vocab_size=768"):
        warm(tiny_target, ckpt)
    ckpt = write_checkpoint(tmp_path / "ok.ckpt", config, random_state(config))
    with pytest.raises(ValueError, match="num_hidden_layers=3 .trained with 2."):
        warm(tiny_target, ckpt, num_hidden_layers=3)


# ---------------------------------------------------------------------------- dflash-train
def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dflash_lab.paths import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _data(tmp_path: Path, target_dir: Path) -> list[str]:
    """The same small slice of demo data for the source run and the warm-started one."""
    return [f"target.path={target_dir}", "data.demo_rows=32", "data.demo_seed=1",
            f"data.demo_file={tmp_path / 'demo.jsonl'}", "data.max_length=128",
            "data.batch_size=8", "data.val_fraction=0.25", "logger=none"]


@pytest.mark.slow
def test_warm_start_validates_at_the_source_tau_and_trains_with_a_fresh_optimizer(
        tiny_target_dir, tmp_path):
    """Step 0 of ``recipe=finetune_cpu`` from the tiny recipe's export gives the source run's
    own val tau on the same data; the fine-tune then counts its steps and AdamW moments from 0."""
    from dflash_lab.train.run import train

    source = train(_compose(["recipe=tiny_cpu", f"paths.output_dir={tmp_path / 'src'}",
                             "trainer.max_steps=8", "trainer.max_epochs=8",
                             *_data(tmp_path, tiny_target_dir)]))
    assert source["val_tau_after"] > source["val_tau_before"] + 0.05  # it learned something
    warm_run = train(_compose(["recipe=finetune_cpu", f"paths.output_dir={tmp_path / 'ft'}",
                               f"drafter.init_from={source['export_dir']}", "trainer.max_steps=1",
                               "export.enabled=false", *_data(tmp_path, tiny_target_dir)]))
    assert warm_run["val_tau_before"] == pytest.approx(source["val_tau_after"], abs=1e-6)
    ckpt = torch.load(Path(warm_run["output_dir"]) / "checkpoints" / "last.ckpt",
                      map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 1
    steps = {float(s["step"]) for s in ckpt["optimizer_states"][0]["state"].values()}
    assert steps == {1.0}  # AdamW state of one step: fresh, not the source's
    assert ckpt["hyper_parameters"]["drafter_config"]["block_size"] == 8  # the source's


def test_a_command_line_drafter_value_overrides_even_when_it_equals_the_group_default(
        tiny_target, tmp_path):
    """``drafter.block_size=16`` on the command line is an override although 16 is
    conf/drafter's own value (which, unset, would leave the source's block size)."""
    from hydra.core.hydra_config import HydraConfig

    from dflash_lab.train.warm_start import explicit_overrides

    fields = group_defaults(None)
    assert "block_size" not in explicit_overrides(fields)
    cfg = _compose_hydra(["drafter.block_size=16"])
    HydraConfig.instance().set_config(cfg)
    try:
        assert explicit_overrides(fields) == {"block_size": 16}
    finally:
        HydraConfig.instance().cfg = None


def _compose_hydra(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dflash_lab.paths import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides, return_hydra_config=True)


# ---------------------------------------------------------------------------- other targets
def test_a_source_recorded_for_another_target_depth_is_refused_unless_ids_are_chosen(
        tiny_target, tmp_path, caplog):
    """Ids [1, 3, 5] exist on the 8-layer tiny target but were chosen on a 12-layer one."""
    config = tiny_source_config(tiny_target, num_target_layers=12)
    state = random_state(config)
    ckpt = write_checkpoint(tmp_path / "deep.ckpt", config, state)
    zdir = write_zlab_dir(tmp_path / "zlab", zlab_dict(config), state)
    for path in (ckpt, zdir):
        with pytest.raises(ValueError, match="target of 12 layers .* the loaded target has 8") \
                as err:
            warm(tiny_target, path)
        assert str(path) in str(err.value)
    with caplog.at_level(logging.WARNING, logger="dflash_lab.train.warm_start"):
        drafter = warm(tiny_target, ckpt, target_layer_ids=[1, 3, 5])  # chosen: reported
    assert drafter.config.num_target_layers == 8
    assert "num_target_layers 12 -> 8" in " ".join(r.getMessage() for r in caplog.records)
    unrecorded = zlab_dict(config)
    unrecorded.pop("num_target_layers")  # no depth recorded: nothing to compare
    drafter = warm(tiny_target, write_zlab_dir(tmp_path / "zlab2", unrecorded, state))
    assert drafter.config.num_target_layers == 8


def test_a_source_trained_on_other_target_weights_is_warned_with_both_fingerprints(
        tiny_target, tmp_path, caplog):
    """A fine-tuned target (same shapes, other values) is a use case: a warning, no refusal."""
    config = tiny_source_config(tiny_target)
    state = random_state(config)
    have = tiny_target.weights_fingerprint()
    assert have  # the tiny target is loaded from files
    for name, recorded, warned in (("other", "f" * 64, True), ("same", have, False)):
        ckpt = write_checkpoint(tmp_path / f"{name}.ckpt", config, state)
        saved = torch.load(ckpt, weights_only=True)
        torch.save({**saved, "dflash_target": {"weights_fingerprint": recorded}}, ckpt)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dflash_lab.train.warm_start"):
            assert_same_weights(warm(tiny_target, ckpt), state)
        text = " ".join(r.getMessage() for r in caplog.records)
        assert (recorded in text and have in text) == warned, text


def test_an_export_carries_the_training_target_and_its_warm_start_warns_the_same(
        tiny_target, tmp_path, caplog):
    """Exports record the checkpoint's target identity (config.json ``dflash_lab_target``, no
    local paths), so a warm start from an export tells other target weights as one from the
    checkpoint does; a re-export carries it on."""
    config = tiny_source_config(tiny_target)
    state = random_state(config)
    have = tiny_target.weights_fingerprint()
    ckpt = write_checkpoint(tmp_path / "src.ckpt", config, state)
    recorded = {**tiny_target.identity(), "weights_fingerprint": "e" * 64}
    torch.save({**torch.load(ckpt, weights_only=True), "dflash_target": recorded}, ckpt)
    out = export_drafter(ckpt, tmp_path / "export", engine="vllm", dtype="float32").out_dir
    written = json.loads((out / "config.json").read_text())["dflash_lab_target"]
    assert written["weights_fingerprint"] == "e" * 64
    assert written["architecture"] == recorded["architecture"]
    assert "name_or_path" not in written and "gguf_file" not in written
    again = export_drafter(out, tmp_path / "again", engine="vllm", dtype="float32").out_dir
    assert json.loads((again / "config.json").read_text())["dflash_lab_target"] == written
    with caplog.at_level(logging.WARNING, logger="dflash_lab.train.warm_start"):
        drafter = warm(tiny_target, out)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "e" * 64 in text and have in text, text
    assert drafter.config.hidden_size == config.hidden_size


# ---------------------------------------------------------------------------- speculators mask
def speculators_visible(anchors_n: torch.Tensor, num_context: int, block_size: int,
                        window: int, causal: bool) -> torch.Tensor:
    """speculators 0.9.0's sliding-layer mask (models/dflash/attention.py,
    create_anchor_block_mask_mod, one document), [Q, K] over our key layout (context, blocks):
    every slot of block j sees context [a_j - W, a_j) and its own block (causal: u <= t)."""
    q = torch.arange(len(anchors_n) * block_size)[:, None]
    kv = torch.arange(num_context + len(anchors_n) * block_size)[None, :]
    a = anchors_n[q // block_size]
    ctx = (kv < num_context) & (kv < a) & (kv >= a - window)
    blk = (kv >= num_context) & ((kv - num_context) // block_size == q // block_size)
    if causal:
        blk = blk & (kv - num_context <= q)
    return ctx | blk


@pytest.mark.parametrize(("window", "block", "non_causal"),
                         [(2, 4, False), (2, 4, True), (8, 4, False)])
def test_speculators_window_is_read_as_w_plus_one_and_what_differs_is_reported(
        tiny_target, tmp_path, caplog, window, block, non_causal):
    """No window of ours equals speculators' block-anchored one (B >= 2); W + 1 is the largest
    whose keys stay inside it (slot 0's context exact). The warning counts the (query, key)
    pairs ours hides, counted here on the two masks themselves."""
    from dflash_lab.attention.mask import BlockLayout, dense_mask

    config = tiny_source_config(tiny_target, sliding_window=window, block_size=block)
    sdir = write_speculators_dir(tmp_path / "spec", speculators_dict(config, non_causal),
                                 random_state(config))
    with caplog.at_level(logging.WARNING, logger="dflash_lab.train.warm_start"):
        spec = warm(tiny_target, sdir).config.layer_specs()[0]
    assert spec.window == window + 1 and spec.causal == (not non_causal)
    context = window + 3  # a full window of context before the block
    anchors = torch.tensor([context])
    ours = dense_mask(BlockLayout(anchors[None], context, block), spec)[0, 0]
    theirs = speculators_visible(anchors, context, block, window, spec.causal)
    assert not (ours & ~theirs).any()  # ours never shows a key speculators hid
    assert torch.equal(ours[0, :context], theirs[0, :context])  # slot 0's context exact
    hidden, seen = int((theirs & ~ours).sum()), int(theirs.sum())
    assert hidden > 0
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "contradicts how the weights were trained" in text
    assert f"read as window {window + 1}" in text and f"({hidden} of {seen} pairs" in text


_SPEC_MASK = """
from speculators.models.dflash.attention import create_anchor_block_mask_mod
a = args[0]
zero = torch.tensor(0)  # or_masks builds its result from the batch index tensor
out = []
for non_causal in (False, True):
    mod, q_len, kv_len = create_anchor_block_mask_mod(
        torch.zeros(a["S"], dtype=torch.long), a["S"], torch.tensor(a["anchors"]), a["B"],
        sliding_window=a["W"], sliding_window_non_causal=non_causal)
    q, kv = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
    out.append(mod(zero, zero, q, kv).tolist())
print(json.dumps(out))
"""


@pytest.mark.skipif(not SPEC_PYTHON.exists(),
                    reason="needs .venv-speculators (make speculators-venv): speculators 0.9.0")
@pytest.mark.slow
def test_the_transcribed_speculators_mask_is_speculators_own(tmp_path):
    """speculators_visible above equals speculators 0.9.0's mask_mod (causal and non-causal
    sliding), run by speculators itself."""
    layout = {"S": 12, "anchors": [2, 5, 9], "B": 4, "W": 3}
    masks = json.loads(run_peer_script(SPEC_PYTHON, _SPEC_MASK, tmp_path, layout))
    for theirs, causal in zip(masks, (True, False), strict=True):
        assert torch.equal(torch.tensor(theirs), speculators_visible(
            torch.tensor(layout["anchors"]), 12, 4, 3, causal=causal))


# ---------------------------------------------------------------------------- step-0 tau
@pytest.mark.slow
def test_step_0_val_tau_equals_the_feature_eval_of_the_source_export(tiny_target,
                                                                     tiny_target_dir, tmp_path):
    """Step 0 of a run warm-started from an export = ``dflash-eval mode=features`` of that
    export (its loader and ``feature_eval``) over the run's validation samples of one capture.

    The two are defined alike only when validation evaluates every valid anchor: it samples
    ``module.num_anchors`` anchors per row from (val_seed, batch index), while features mode
    evaluates every anchor (``features.num_anchors=null``) or seeds per sample. With
    ``num_anchors`` above every row's candidate count (max_length 64: at most 63) validation
    takes them all; both then pool ``1 + leading correct slots`` over the same blocks
    (validation over all its batches, features over all samples), with the same features read
    from the shards. Only the validation split is evaluated: features mode reads a whole
    capture, so ``feature_eval`` (what it calls) gets the run's own ``val_set``.
    """
    from dflash_lab.data.capture_loop import CaptureSettings, run_capture
    from dflash_lab.data.module import OfflineDataModule
    from dflash_lab.eval.offline_tau import feature_eval
    from dflash_lab.targets.demo_corpus import demo_conversations
    from dflash_lab.train.run import train

    cap = tmp_path / "capture"
    rows = [{"messages": c} for c in demo_conversations(40, seed=3)]
    run_capture(tiny_target, rows, CaptureSettings(out_dir=str(cap), target_layer_ids=[1, 3, 5],
                                                   shard_size=16, batch_size=8, max_length=64),
                {"path": "demo-seed3"}, progress=False)
    # tiny_cpu's choices on captured data (the recipe itself selects data=online)
    common = ["target=tiny", f"target.path={tiny_target_dir}", "trainer=cpu", "logger=none",
              "drafter.backend=sdpa", "data=offline", f"data.path={cap}", "data.batch_size=4",
              "data.val_fraction=0.2", "data.num_workers=0", "module.num_anchors=64",
              "module.gamma=4.0"]
    source = train(_compose([*common, f"paths.output_dir={tmp_path / 'src'}",
                             "drafter.num_hidden_layers=2", "drafter.block_size=8",
                             "drafter.target_layer_ids=3", "module.optimizer.lr=3e-3",
                             "trainer.max_steps=10", "trainer.max_epochs=10",
                             "export.enabled=true", "export.dtype=float32"]))
    assert source["val_tau_after"] > source["val_tau_before"] + 0.05  # not a trivial tau of 1
    warm_run = train(_compose([*common, f"paths.output_dir={tmp_path / 'ft'}",
                               f"drafter.init_from={source['export_dir']}",
                               "trainer.max_steps=1", "export.enabled=false"]))
    split = OfflineDataModule(str(cap), batch_size=4, val_fraction=0.2, seed=0)
    split.setup()
    report = feature_eval(load_drafter(source["export_dir"]).drafter, tiny_target.pieces(),
                          split.val_set, num_anchors=None, progress=False)
    assert report["num_blocks"] > 100
    assert warm_run["val_tau_before"] == pytest.approx(report["tau_mean"], abs=1e-6)
