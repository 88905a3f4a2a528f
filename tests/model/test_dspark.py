"""DSpark heads (dflash_lab/heads/dspark.py): formulas, identity init, config, speculators
parity."""

import json
import subprocess

import pytest
import torch

from dflash_lab.heads.dspark import ConfidenceHead, MarkovHead
from dflash_lab.model.config import DSPARK_DEFAULTS, DrafterConfig
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.paths import REPO_ROOT
from tests.doubles import tiny_drafter_config

SPEC_PYTHON = REPO_ROOT / ".venv-speculators" / "bin" / "python"
H, V, R = 12, 23, 5


def _head(kind: str, seed: int = 0, draft_vocab: int = V) -> MarkovHead:
    torch.manual_seed(seed)
    head = MarkovHead(H, V, draft_vocab, R, kind).double()
    with torch.no_grad():  # away from the identity init, so every term matters
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return head


def _reference_bias(head: MarkovHead, prev_nk, hidden_nkh):
    """The formulas of docs/dspark.md, written out slot by slot."""
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    n, k = prev_nk.shape
    out = torch.zeros(n, k, w2.shape[0], dtype=w2.dtype)
    for i in range(n):
        s = torch.zeros(R, dtype=w2.dtype)
        for t in range(k):
            e, h = w1[prev_nk[i, t]], hidden_nkh[i, t]
            if head.head_type == "vanilla":
                f = e
            elif head.head_type == "gated":
                z = head.gate_proj.weight @ torch.cat([h, e]) + head.gate_proj.bias
                f = torch.sigmoid(z) * e
            else:
                z = head.joint_proj.weight @ torch.cat([s, e, h]) + head.joint_proj.bias
                g, c, o = torch.sigmoid(z[:R]), z[R:2 * R], z[2 * R:]
                s = g * s + (1 - g) * torch.tanh(c)
                f = torch.tanh(o)
            out[i, t] = w2 @ f
    return out


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_markov_bias_matches_the_formula(kind):
    head = _head(kind)
    prev = torch.randint(0, V, (3, 4))
    hidden = torch.randn(3, 4, H, dtype=torch.float64)
    feats, emb = head.features(prev, hidden)
    torch.testing.assert_close(head.bias(feats), _reference_bias(head, prev, hidden))
    torch.testing.assert_close(emb, head.markov_w1.weight[prev])


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_walk_conditions_each_slot_on_the_token_it_drafted_before(kind):
    """Greedy walk = the teacher-forced bias given the walked tokens (anchor first)."""
    head = _head(kind, seed=1)
    hidden = torch.randn(5, H, dtype=torch.float64)
    base = torch.randn(5, V, dtype=torch.float64) * 0.3
    tokens, emb = head.walk(base, hidden, 7, lambda z: z.argmax(-1), lambda b: b)
    prev = torch.cat([torch.tensor([7]), tokens[:-1]])
    forced = base + _reference_bias(head, prev[None], hidden[None])[0]
    assert torch.equal(tokens, forced.argmax(-1))
    torch.testing.assert_close(emb, head.markov_w1.weight[prev])
    assert not torch.equal(tokens, base.argmax(-1)), "fixture: the bias must change a pick"


def test_confidence_head_formula():
    torch.manual_seed(0)
    for with_markov in (True, False):
        conf = ConfidenceHead(H, R, with_markov)
        h, e = torch.randn(4, H), torch.randn(4, R)
        x = torch.cat([h, e], -1) if with_markov else h
        want = x @ conf.proj.weight[0] + conf.proj.bias[0]
        torch.testing.assert_close(conf(h, e), want)


def test_config_defaults_fields_and_round_trip():
    cfg = tiny_drafter_config(variant="dspark", sample_from_anchor=True)
    assert {k: getattr(cfg, k) for k in DSPARK_DEFAULTS} == DSPARK_DEFAULTS
    back = DrafterConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and back.to_dict()["architectures"] == ["Qwen3DSparkModel"]
    plain = tiny_drafter_config()
    assert "markov_rank" not in json.dumps(plain.to_dict())  # dflash1 files unchanged
    with pytest.raises(ValueError, match="markov_rank.*variant='dspark'"):
        tiny_drafter_config(markov_rank=8)
    with pytest.raises(ValueError, match="markov_head_type='lstm'.*vanilla"):
        tiny_drafter_config(variant="dspark", markov_head_type="lstm")
    with pytest.raises(ValueError, match="confidence_head_with_markov.*markov_rank > 0"):
        tiny_drafter_config(variant="dspark", markov_rank=0)
    with pytest.raises(ValueError, match="output_multiplier.*dspark"):
        tiny_drafter_config(variant="dspark", output_multiplier=2.0)


def _drafters(kind: str, sample_from_anchor: bool):
    torch.manual_seed(0)
    spark = DFlashDrafter(tiny_drafter_config(
        variant="dspark", markov_head_type=kind, markov_rank=R,
        sample_from_anchor=sample_from_anchor)).double()
    plain = DFlashDrafter(tiny_drafter_config(sample_from_anchor=sample_from_anchor)).double()
    missing, unexpected = plain.load_state_dict(spark.state_dict(), strict=False)
    assert not missing and all(k.split(".")[0] in ("markov_head", "confidence_head")
                               for k in unexpected) and unexpected
    return spark, plain


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_fresh_dspark_drafts_exactly_like_dflash1(kind, sample_from_anchor):
    spark, plain = _drafters(kind, sample_from_anchor)
    cfg = spark.config
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).double().requires_grad_(False)
    lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).double()
    hidden = torch.randn(2, 11, len(cfg.target_layer_ids) * cfg.hidden_size, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size - 1, (2,))
    drafts = []
    for model in (plain, spark):
        cache = model.new_cache()
        model.extend_context(cache, hidden)
        out = model.draft(cache, ids, embed)
        drafts.append(model.propose(out, ids, lm_head))
    assert drafts[0].shape == (2, cfg.num_draft_tokens) and torch.equal(*drafts)
    with torch.no_grad():  # guard: a trained w2 changes the draft
        for p in spark.markov_head.parameters():
            p.normal_(std=3.0)
    cache = spark.new_cache()
    spark.extend_context(cache, hidden)
    assert not torch.equal(spark.propose(spark.draft(cache, ids, embed), ids, lm_head), drafts[0])


def test_state_dict_uses_the_vllm_and_speculators_names():
    spark = DFlashDrafter(tiny_drafter_config(variant="dspark", markov_rank=R))
    heads = {k: tuple(v.shape) for k, v in spark.state_dict().items()
             if k.startswith(("markov", "confidence"))}
    assert heads == {"markov_head.markov_w1.weight": (97, R),
                     "markov_head.markov_w2.weight": (97, R),
                     "confidence_head.proj.weight": (1, 48 + R),
                     "confidence_head.proj.bias": (1,)}


#: Run in .venv-speculators: speculators' own MarkovHead / ConfidenceHead on the weights in
#: argv[1] (a torch file), writing their outputs to argv[2].
_SPEC_CHECK = r"""
import sys, torch
from speculators.models.dspark.model_definitions import ConfidenceHead, MarkovHead
case = torch.load(sys.argv[1])
out = {}
for kind, sd in case["heads"].items():
    h = MarkovHead(verifier_vocab_size=case["V"], draft_vocab_size=case["V"],
                   markov_rank=case["R"], hidden_size=case["H"], head_type=kind).double()
    h.load_state_dict(sd)
    out[kind] = h.block_bias(prev_token_ids=case["prev"], hidden_states=case["hidden"])
c = ConfidenceHead(case["H"] + case["R"]).double()
c.load_state_dict(case["conf"])
out["conf"] = c(torch.cat([case["hidden"], case["emb"]], -1))
torch.save(out, sys.argv[2])
"""


def test_heads_match_speculators_on_the_same_weights(tmp_path):
    if not SPEC_PYTHON.exists():
        pytest.skip(f"needs {SPEC_PYTHON} (make speculators-venv): speculators 0.9.0")
    heads = {kind: _head(kind, seed=i) for i, kind in enumerate(("vanilla", "gated", "rnn"))}
    prev = torch.randint(0, V, (3, 4))
    hidden = torch.randn(3, 4, H, dtype=torch.float64)
    conf = ConfidenceHead(H, R, True).double()
    emb = heads["vanilla"].embed(prev)
    torch.save({"heads": {k: h.state_dict() for k, h in heads.items()}, "conf": conf.state_dict(),
                "prev": prev, "hidden": hidden, "emb": emb, "V": V, "R": R, "H": H},
               tmp_path / "case.pt")
    subprocess.run([str(SPEC_PYTHON), "-c", _SPEC_CHECK, str(tmp_path / "case.pt"),
                    str(tmp_path / "out.pt")], check=True, timeout=300)
    theirs = torch.load(tmp_path / "out.pt")
    for kind, head in heads.items():
        torch.testing.assert_close(head.bias(head.features(prev, hidden)[0]), theirs[kind])
    torch.testing.assert_close(conf(hidden, emb), theirs["conf"].float())
