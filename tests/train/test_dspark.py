"""DSpark training (dflash_lab/heads/dspark.py): the Markov-biased CE and the confidence BCE
computed by hand, the teacher-forced previous tokens, gradients, and the tiny recipe."""

import csv
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.heads.dspark import markov_prev_ids
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.paths import CONF_DIR
from dflash_lab.train.loss import position_weights, slot_positions
from dflash_lab.train.module import DFlashModule
from tests.doubles import tiny_drafter_config

GAMMA = 2.0


def _module(kind="vanilla", alpha=0.7, sample_from_anchor=True, **overrides):
    cfg = tiny_drafter_config(variant="dspark", markov_rank=6, markov_head_type=kind,
                              sample_from_anchor=sample_from_anchor, **overrides)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():  # a trained-looking Markov head (fresh: markov_w2 = 0)
        for p in drafter.markov_head.parameters():
            p.normal_(std=0.5)
    head = torch.nn.Module()
    head.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    return DFlashModule(drafter, head, optimizer=torch.optim.SGD, gamma=GAMMA,
                        label_source="dataset", confidence_head_alpha=alpha)


def _batch(module, bt=2, seq=24, seed=3):
    cfg = module.drafter.config
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(bt, seq)
    mask[0, 9] = 0
    batch = {"hidden": torch.randn(bt, seq, 3 * cfg.hidden_size, generator=g),
             "input_ids": torch.randint(0, 90, (bt, seq), generator=g), "loss_mask": mask}
    anchors = torch.tensor([[1, 6, 11, 20]] * bt)
    valid = torch.ones(bt, 4, dtype=torch.bool)
    valid[-1, -1] = False
    return batch, anchors, valid


def _by_hand(module, batch, anchors, valid):
    """The objective from full [.., V] logits, slot by slot (docs/dspark.md)."""
    d, cfg = module.drafter, module.drafter.config
    ids, seq, b = batch["input_ids"], batch["input_ids"].shape[1], cfg.block_size
    hidden = d(batch["hidden"], ids, anchors, module.target_head.embed_tokens)
    pos = slot_positions(anchors, b, cfg.label_shift)
    w = position_weights(b, GAMMA, first_slot=cfg.first_draft_slot)
    ce_sum = w_sum = bce_sum = count = 0.0
    for i in range(ids.shape[0]):
        for j in range(anchors.shape[1]):
            prev = torch.tensor([int(ids[i, p - 1]) if p - 1 >= anchors[i, j] else
                                 int(ids[i, anchors[i, j]]) for p in pos[i, j].tolist()])
            feats, emb = d.markov_head.features(prev[None], hidden[i, j][None])
            logits = module.target_head.lm_head(hidden[i, j]) + d.markov_head.bias(feats)[0]
            for t, p in enumerate(pos[i, j].tolist()):
                if (not valid[i, j] or t < cfg.first_draft_slot or p >= seq
                        or not batch["loss_mask"][i, p]):
                    continue
                ce = F.cross_entropy(logits[t], ids[i, p])
                ce_sum, w_sum = ce_sum + w[t] * ce, w_sum + w[t]
                conf = d.confidence_head.proj(torch.cat([hidden[i, j, t], emb[0, t]]))[0]
                bce = F.binary_cross_entropy_with_logits(conf, torch.exp(-ce.detach()))
                bce_sum, count = bce_sum + w[t] * bce, count + 1
    return ce_sum / w_sum + module.hparams.confidence_head_alpha * bce_sum / count


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_objective_is_markov_ce_plus_alpha_confidence_bce_by_hand(kind, sample_from_anchor):
    module = _module(kind, sample_from_anchor=sample_from_anchor)
    batch, anchors, valid = _batch(module)
    ours = module.objective(module.blocks_loss(batch, anchors, valid), 0)
    torch.testing.assert_close(ours, _by_hand(module, batch, anchors, valid))


def test_prev_tokens_are_the_data_tokens_before_each_slot_with_dataset_labels():
    """speculators' DSpark convention (sample_from_anchor: slot k sees the token at a + k)."""
    ids = torch.arange(100, 130)[None]
    anchors = torch.tensor([[2, 10]])
    prev = markov_prev_ids(ids, ids, anchors, 4, label_shift=1)
    assert prev.tolist() == [[[102, 103, 104, 105], [110, 111, 112, 113]]]
    labels = ids.clone()
    labels[0, 11] = 7  # target-argmax labels: the label, not the data token
    labels[0, 12] = -1  # no label: the data token
    prev = markov_prev_ids(ids, labels, anchors, 4, label_shift=1)
    assert prev[0, 1].tolist() == [110, 7, 112, 113]
    dflash = markov_prev_ids(ids, ids, anchors, 4, label_shift=0)  # slot 0 = anchor: its token
    assert dflash[0, 0].tolist() == [102, 102, 103, 104]


def test_gradients_reach_both_heads_and_a_fresh_head_trains_w2_first():
    module = _module()
    batch, anchors, valid = _batch(module)
    module.objective(module.blocks_loss(batch, anchors, valid), 0).backward()
    grads = {n: p.grad for n, p in module.drafter.named_parameters()}
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                 "confidence_head.proj.weight", "confidence_head.proj.bias", "fc.weight"):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    fresh = _module()
    fresh.drafter.markov_head.reset_parameters()
    fresh.objective(fresh.blocks_loss(batch, anchors, valid), 0).backward()
    assert fresh.drafter.markov_head.markov_w2.weight.grad.abs().sum() > 0


def test_negative_alpha_is_refused_and_a_distribution_loss_is_not():
    with pytest.raises(ValueError, match="confidence_head_alpha=-1"):
        _module(alpha=-1.0)
    cfg = tiny_drafter_config(variant="dspark", markov_rank=6)
    head = torch.nn.Module()
    head.embed_tokens = torch.nn.Embedding(97, 48)
    head.lm_head = torch.nn.Linear(48, 97, bias=False)
    module = DFlashModule(DFlashDrafter(cfg), head, optimizer=torch.optim.SGD,
                          loss={"ce": 0.5, "tv": 0.5}, target_distribution={"last_hidden": True})
    assert module.teacher_kind == "dense"


@pytest.mark.parametrize("loss", [{"kl": 1.0}, {"ce": 0.1, "tv": 0.9}])
def test_a_distribution_loss_trains_markov_w2_and_the_confidence_head(loss):
    """The distribution pass gives ConcatHead's markov_w2 its gradient (SGD steps lower the
    loss); the confidence BCE still reads each slot's CE."""
    module = _module()
    module = DFlashModule(module.drafter, module.target_head, optimizer=torch.optim.SGD,
                          gamma=GAMMA, label_source="dataset", loss=loss,
                          target_distribution={"last_hidden": True})
    batch, anchors, valid = _batch(module)
    batch["target_last_hidden"] = torch.randn(*batch["input_ids"].shape, 48,
                                              generator=torch.Generator().manual_seed(4))
    opt = torch.optim.SGD(module.drafter.parameters(), lr=0.5)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        out = module.blocks_loss(batch, anchors, valid)
        assert out.head_pieces["confidence"] is not None
        loss_value = module.objective(out, 0)
        loss_value.backward()
        w2 = module.drafter.markov_head.markov_w2.weight.grad
        assert torch.isfinite(loss_value) and w2.abs().sum() > 0
        assert module.drafter.confidence_head.proj.weight.grad.abs().sum() > 0
        losses.append(loss_value.item())
        opt.step()
    assert losses[-1] < losses[0]


# ----------------------------------------------------------------------------- Lightning
def _compose(tmp_path, target_dir, **extra):
    # the demo with a DSpark drafter (recipes/tiny_cpu_dspark.yaml runs the whole pipeline)
    base = {"recipe": "tiny_cpu", "drafter": "dspark", "drafter.markov_rank": 64,
            "drafter.markov_head_type": "vanilla", "module.confidence_head_alpha": 1.0,
            "export.enabled": "false", "paths.output_dir": str(tmp_path / "run"),
            "target.path": str(target_dir), "data.demo_rows": 24,
            "data.demo_file": str(tmp_path / "demo.jsonl"), "data.max_length": 96,
            "data.batch_size": 8, "data.val_fraction": 0.25, "logger": "csv",
            "trainer.log_every_n_steps": 1, "module.num_anchors": 8,
            "callbacks.progress": "null", "trainer.max_epochs": 1}
    base.update(extra)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[f"{k}={v}" for k, v in base.items()])


def test_tiny_recipe_trains_and_logs_the_confidence_terms(tiny_target_dir, tmp_path):
    from dflash_lab.train.run import train

    result = train(_compose(tmp_path, tiny_target_dir))
    run_dir = Path(result["output_dir"])
    rows = []
    for path in sorted((run_dir / "csv").glob("version_*/metrics.csv")):
        with path.open() as f:
            rows += list(csv.DictReader(f))
    keys = {k for r in rows for k, v in r.items() if v}
    assert {"train/loss", "train/confidence_loss", "train/confidence_abs_error", "val/tau",
            "train/tau"} <= keys, keys
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)
    assert {"drafter.markov_head.markov_w1.weight", "drafter.confidence_head.proj.bias"} <= set(
        ckpt["state_dict"])
    w2 = ckpt["state_dict"]["drafter.markov_head.markov_w2.weight"]
    assert w2.abs().sum() > 0  # trained away from the identity init


def test_tiny_recipe_trains_markov_w2_with_a_distribution_loss(tiny_target_dir, tmp_path):
    """module.loss={kl: 1.0} on the tiny target (online: its last hidden state is the teacher):
    training and validation run the distribution pass on ConcatHead, markov_w2 learns."""
    from dflash_lab.train.run import train

    result = train(_compose(tmp_path, tiny_target_dir, **{"module.loss": "{kl: 1.0}",
                                                          "trainer.max_steps": 3}))
    run_dir = Path(result["output_dir"])
    metrics = "".join(p.read_text() for p in (run_dir / "csv").glob("version_*/metrics.csv"))
    assert "train/loss_kl" in metrics and "train/confidence_loss" in metrics
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)
    assert ckpt["state_dict"]["drafter.markov_head.markov_w2.weight"].abs().sum() > 0
    assert result["val_tau_after"] >= 1.0


def test_a_dspark_run_exporting_for_sglang_is_refused_before_training(tiny_target_dir, tmp_path):
    """SGLang cannot load vLLM's speculators DSpark layout (export/dspark.py): an end-of-run
    export for both engines is refused at start-up naming SGLang and the fix, not after
    training."""
    from dflash_lab.train.run import train

    with pytest.raises(ValueError, match="SGLang 0.5.23.*--engine vllm"):
        train(_compose(tmp_path, tiny_target_dir, **{"export.enabled": "true",
                                                      "export.engine": "both"}))
    assert not (tmp_path / "run" / "checkpoints").exists()
