"""A Domino drafter (recipes/tiny_cpu_domino.yaml's, on the built-in tiny target) exports for
SGLang only (vLLM refused by name before anything is written), inspects, loads back for eval and
decodes losslessly with its GRU walk; and SGLang's own parser, DFlashDraftModel.load_weights and
domino_greedy_rollout, run on that export and our backbone's hidden states, draft what our walk
drafts (pool 0 and a small pool)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_lab.export import inspect_dir
from dflash_lab.export.weights import Source
from dflash_lab.heads.domino import domino_walk
from dflash_lab.model.drafter import DFlashDrafter
from scripts import engine_sources as es
from tests.eval_doubles import export_decodes_losslessly, refused_then_served
from tests.export.test_golden import _recipe_config

POOLS = (0, 16)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_target_dir):
    """The recipe's drafter with random weights (a correction large enough to change drafts),
    exported as the recipe does (SGLang, bfloat16) into ``cache/domino_case/export``."""
    tmp = tmp_path_factory.mktemp("domino")
    config, _ = _recipe_config("tiny_cpu_domino", tmp, tiny_target_dir)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        drafter.embed_proj[2].weight.normal_(std=2.0)
    out = tmp / "cache" / es.DOMINO_CASE / "export"
    source = Source(config, drafter.state_dict(), "checkpoint", "tiny domino")
    return refused_then_served(source, out, ("both", "vllm"), "sglang", "bfloat16",
                               "vllm does not serve a Domino drafter .*--engine sglang")


def test_the_export_inspects_and_decodes_losslessly_with_the_walk(exported, tiny_target):
    inspected = inspect_dir(exported)  # the engines it was made for: SGLang's rule sets
    assert inspected.status == "ok", inspected.problems
    assert "- variant: domino (DFlashDraftModel)" in inspected.text
    assert "gru_hidden_dim=64" in inspected.text
    drafter = export_decodes_losslessly(exported, tiny_target)
    assert drafter.config.head.name == "domino" and drafter.config.gru_hidden_dim == 64


def _case(exported: Path, tiny_target) -> tuple[dict, list[list[int]]]:
    """Our backbone's hidden rows of 3 blocks [3, B, H] and our walk's drafts at each pool;
    written with the target's embedding and LM head for the probe."""
    from dflash_lab.eval.loading import load_drafter

    drafter = load_drafter(exported).drafter
    pieces, cfg = tiny_target.pieces(), drafter.config
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(1, 40, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=g)
    anchors = torch.tensor([[3, 17, 30]])
    with torch.no_grad():
        hidden = drafter(feats, ids, anchors, pieces.embed_tokens)[0].float()  # [3, B, H]
        lm_w = pieces.lm_head.weight.float()
        ours = {pool: [domino_walk(drafter.prefix_gru, drafter.embed_proj, pieces.embed_tokens,
                                   h[1:], h[1:] @ lm_w.T, int(a), pool).tolist()
                       for h, a in zip(hidden, ids[0, anchors[0]])] for pool in POOLS}
    inputs = {"hidden": hidden.contiguous(), "anchors": ids[0, anchors[0]].contiguous(),
              "embed": pieces.embed_tokens.weight.float().contiguous(),
              "lm_head": lm_w.contiguous(), "pools": torch.tensor(POOLS)}
    save_file(inputs, str(exported.parent / "inputs.safetensors"))
    return ours, hidden


def test_sglang_parses_loads_and_drafts_our_export_as_our_walk(exported, tiny_target):
    venv, make = es.PROBE_VENVS["domino-export"]
    if not (es.ROOT / venv / "bin" / "python").exists():
        pytest.skip(f"needs SGLang 0.5.23 in {venv}: run `{make}`")
    ours, hidden = _case(exported, tiny_target)
    unary = [(h[1:] @ tiny_target.pieces().lm_head.weight.float().T).argmax(-1).tolist()
             for h in hidden]
    assert ours[0] != unary  # the GRU correction changed drafts: the comparison sees it
    result = es.run_probe("domino-export", cache=exported.parent.parent)
    assert result["parsed"] == {"projector_type": "domino", "shift_label": False,
                                "pure_draft_prefix_len": 1, "gru_hidden_dim": 64, "emb_dim": 32,
                                "block_size": 8}
    assert result["load_refusal"] is None
    assert result["head_landed"] == ["embed_proj.0.weight", "embed_proj.2.weight",
                                     "prefix_gru.weight_hh_l0", "prefix_gru.weight_ih_l0"]
    for pool in POOLS:
        assert result[f"drafts_pool{pool}"] == ours[pool], pool


def test_dflash_eval_sets_the_walks_candidate_pool(exported, tiny_target_dir, tmp_path,
                                                   monkeypatch, capsys):
    """``drafter.walk={candidate_pool_size:P}`` reaches the walk; a key it does not take is one
    error line naming the keys it takes (exit 2)."""
    from tests.eval_doubles import cli_eval_report, demo_prompts

    prompts = demo_prompts(tmp_path / "prompts.jsonl")
    report = cli_eval_report(monkeypatch, tiny_target_dir, exported, prompts, tmp_path / "ev",
                             "drafter.walk={candidate_pool_size:0}")
    assert report["lossless"] is True
    with pytest.raises(SystemExit) as stop:
        cli_eval_report(monkeypatch, tiny_target_dir, exported, prompts, tmp_path / "bad",
                        "drafter.walk={pool:3}")
    assert stop.value.code == 2
    assert "drafter.walk.pool: the Domino walk takes ['candidate_pool_size']" in (
        capsys.readouterr().err)

