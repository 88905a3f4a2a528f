"""Training: no cheating through the anchor, a short fit learns, resume, DDP, start-up errors."""

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.attention import mask as mask_module
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.paths import CONF_DIR, REPO_ROOT
from dflash_lab.train.factory import build_drafter
from dflash_lab.train.loss import block_targets, global_weighted_loss
from dflash_lab.train.module import DFlashModule
from dflash_lab.train.objective import dflash_loss
from dflash_lab.train.run import build_components
from tests.doubles import tiny_drafter_config
from tests.stand_ins import config_target


# ----------------------------------------------------------------------------- the cheat
def _slot1_accuracy_after_training(steps: int = 60) -> float:
    """Features at position p reveal the token at p + 1 (like a target's next-token state).
    Tokens are i.i.d., so slot 1 (position a + 1) is unpredictable from context < a + 1 ...
    unless the drafter can see the anchor's own features."""
    torch.manual_seed(0)
    vocab, seq = 12, 24
    cfg = tiny_drafter_config("full_bidirectional", vocab_size=vocab, mask_token_id=vocab - 1,
                              block_size=3, num_hidden_layers=1, layer_types=["full_attention"])
    drafter = DFlashDrafter(cfg)
    embed = torch.nn.Embedding(vocab, cfg.hidden_size).requires_grad_(False)
    head = torch.nn.Linear(cfg.hidden_size, vocab, bias=False)
    code = torch.randn(vocab, 3 * cfg.hidden_size)
    opt = torch.optim.Adam(list(drafter.parameters()) + list(head.parameters()), lr=1e-2)
    anchors = torch.arange(1, seq - 3, 2)[None].expand(16, -1)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    for _ in range(steps):
        ids = torch.randint(0, vocab - 1, (16, seq))
        feats = code[torch.roll(ids, -1, dims=1)]  # feature p encodes token p + 1
        tgt = block_targets(ids, torch.ones(16, seq), anchors, valid, cfg.block_size)
        out = dflash_loss(drafter(feats, ids, anchors, embed), tgt, head, gamma=4.0)
        opt.zero_grad()
        (out.weighted_sum / out.weight_sum).backward()
        opt.step()
    return out.correct[..., 1].float().mean().item()


def test_drafter_cannot_see_the_anchors_own_features(monkeypatch):
    honest = _slot1_accuracy_after_training()
    assert honest < 0.3, "slot 1 became predictable: the anchor's features leaked"
    # The same run with the classic bug (context visible up to AND including the anchor)
    # drives slot-1 accuracy to ~1: proof that this test can fail.
    real = mask_module.visible

    def leaky(q_idx, kv_idx, anchors, num_context, block_size, spec, starts=None):
        anchor = anchors[q_idx // block_size]
        return real(q_idx, kv_idx, anchors, num_context, block_size, spec, starts) | (
            (kv_idx < num_context) & (kv_idx == anchor))

    monkeypatch.setattr(mask_module, "visible", leaky)
    assert _slot1_accuracy_after_training() > 0.8


# ----------------------------------------------------------------------------- configs
def _compose(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _tiny_overrides(tmp_path, target_dir, rows=48, **extra):
    base = {"recipe": "tiny_cpu", "paths.output_dir": str(tmp_path / "run"),
            "target.path": str(target_dir), "data.demo_rows": rows,
            "data.demo_file": str(tmp_path / "demo.jsonl"), "data.max_length": 128,
            "data.batch_size": 8, "data.val_fraction": 0.25, "logger": "csv",
            "export.enabled": False}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def test_short_fit_learns_well_above_the_untrained_drafter(tiny_target_dir, tmp_path):
    from dflash_lab.train.run import train

    cfg = _compose(_tiny_overrides(tmp_path, tiny_target_dir, rows=160, **{
        "trainer.max_epochs": 8, "module.optimizer.lr": 3e-3, "export.enabled": True,
        "logger": "wandb"}))  # wandb offline: files only, no network
    result = train(cfg)
    assert result["val_tau_before"] < 1.5
    assert result["val_tau_after"] > result["val_tau_before"] + 1.0
    best = Path(result["best_checkpoint"])
    assert best.is_file() and (best.parent / "last.ckpt").is_file()
    assert (best.parent / "best.json").is_file()
    assert (Path(result["export_dir"]) / "model.safetensors").is_file()
    run_dir = Path(result["output_dir"])
    assert (run_dir / "config.yaml").is_file() and (run_dir / "run_info.json").is_file()
    offline_runs = list((run_dir / "wandb").glob("offline-run-*/*.wandb"))
    assert offline_runs, "wandb (offline) recorded nothing"
    for _ in range(50):  # wandb's service process may still be flushing the artifact record
        if b"EXPORT_REPORT" in offline_runs[0].read_bytes():
            break
        time.sleep(0.2)
    assert b"EXPORT_REPORT" in offline_runs[0].read_bytes()  # the exported drafter artifact
    ckpt = torch.load(best, map_location="cpu", weights_only=True)
    assert not any(k.startswith("target_head.") for k in ckpt["state_dict"])
    assert ckpt["hyper_parameters"]["drafter_config"]["block_size"] == 8


@pytest.mark.parametrize(("override", "message"), [
    ({"drafter.block_size": 1}, "block_size"),
    ({"drafter.layer_types": "[sliding_attention,sliding_attention]",
      "drafter.sliding_window": 0}, "sliding_window"),
    ({"module.gamma": 0}, "gamma=0"),
    ({"drafter.target_layer_ids": "[1,9]"}, "target_layer_ids"),
])
def test_bad_configs_fail_at_start_up_with_a_clear_message(tiny_target_dir, tmp_path, override,
                                                          message):
    cfg = _compose(_tiny_overrides(tmp_path, tiny_target_dir, **override))
    with pytest.raises(Exception, match=message):
        build_components(cfg)


def test_missing_capture_fails_at_start_up(tiny_target_dir, tmp_path):
    cfg = _compose(["data=offline", "data.path=/nonexistent/capture", "logger=none",
                    f"target.path={tiny_target_dir}", "drafter.target_layer_ids=3",
                    f"paths.output_dir={tmp_path}"])
    with pytest.raises(Exception, match="no manifest"):
        build_components(cfg)


# ----------------------------------------------------------------------------- resume
#: The repository root on a subprocess's import path: the package (not installed) and the
#: ``tests`` package, whose doubles a run's config may name (``tests.doubles.kill_at_step_callback``
#: as a callback's ``_target_``).
SUBPROCESS_PYTHONPATH = str(REPO_ROOT)


def _run_cli(overrides, check=True):
    env = dict(os.environ, PYTHONPATH=SUBPROCESS_PYTHONPATH)
    return subprocess.run([sys.executable, "-m", "dflash_lab.train.cli", *overrides],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=check,
                          timeout=600)


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for metrics in sorted((run_dir / "csv").glob("version_*/metrics.csv")):
        with metrics.open() as f:
            for row in csv.DictReader(f):
                if row.get("train/loss"):
                    out[int(row["step"])] = float(row["train/loss"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("trainer", "epochs", "last_every", "kill_at", "resumed_at"), [
    ("cpu", 2, None, 7, 5), ("cpu", 2, 3, 7, 6), ("ddp_cpu", 4, 4, 8, 8)],
    ids=["epoch-end-ckpt", "mid-epoch-ckpt", "ddp-2-processes-mid-epoch-ckpt"])
def test_resume_after_a_kill_continues_the_same_loss_curve(tiny_target_dir, tmp_path, trainer,
                                                           epochs, last_every, kill_at,
                                                           resumed_at):
    """SIGKILLed at step ``kill_at`` and resumed from last.ckpt: one process (5 steps an
    epoch) from the epoch-end checkpoint of step 5 or the mid-epoch one of step 6; two gloo
    processes (3 steps an epoch, each rank its own share) from the mid-epoch one of step 8."""
    common = {"trainer": trainer, "trainer.max_epochs": epochs, "trainer.log_every_n_steps": 1,
              "validate_before_fit": False,
              "callbacks.checkpoint.last_every_n_steps": "null" if last_every is None
              else last_every}
    ref = _tiny_overrides(tmp_path / "ref", tiny_target_dir, **common)
    _run_cli(ref)
    killed = _tiny_overrides(tmp_path / "kill", tiny_target_dir, **common)
    kill = ["+callbacks.kill._target_=tests.doubles.kill_at_step_callback",
            f"+callbacks.kill.step={kill_at}"]
    proc = _run_cli(killed + kill, check=False)
    assert proc.returncode != 0, "the run was supposed to be killed"
    last = tmp_path / "kill/run/checkpoints/last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == resumed_at
    _run_cli(killed)  # ckpt_path=auto resumes from last.ckpt
    want, got = _losses(tmp_path / "ref/run"), _losses(tmp_path / "kill/run")
    assert max(want) == max(got) and max(want) > kill_at
    for step in range(resumed_at - 1, max(want) + 1):  # steps after the resume point included
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step


# ----------------------------------------------------------------------------- DDP
@pytest.mark.slow
def test_lightning_ddp_with_two_cpu_processes_trains_end_to_end(tiny_target_dir, tmp_path):
    overrides = _tiny_overrides(tmp_path, tiny_target_dir, **{
        "trainer": "ddp_cpu", "trainer.max_epochs": 1, "+trainer.limit_train_batches": 3,
        "validate_before_fit": False})
    proc = _run_cli(overrides)
    assert "val tau:" in proc.stdout and "-> trained" in proc.stdout
    assert (tmp_path / "run/checkpoints/last.ckpt").is_file()


def _ddp_worker(rank: int, world: int, port: int, result_file: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world)
    module, batch, anchors, valid = _ddp_problem()
    rows = slice(rank * 2, rank * 2 + 2)  # uneven numbers of valid slots per rank
    part = {k: v[rows] for k, v in batch.items()}
    out = module.blocks_loss(part, anchors[rows], valid[rows])

    def all_sum(t):
        torch.distributed.all_reduce(t)
        return t

    loss = global_weighted_loss(out.weighted_sum, out.weight_sum, world, all_sum)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in module.drafter.parameters()])
    torch.distributed.all_reduce(grads)
    grads /= world  # what DDP does
    if rank == 0:
        torch.save(grads, result_file)
    torch.distributed.destroy_process_group()


def _ddp_problem():
    torch.manual_seed(0)
    cfg = tiny_drafter_config("mixed_swa")
    head = torch.nn.Module()
    head.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    module = DFlashModule(DFlashDrafter(cfg), head, optimizer=torch.optim.SGD, gamma=4.0,
                          label_source="dataset")
    seq = 20
    loss_mask = torch.ones(4, seq, dtype=torch.bool)
    loss_mask[2:, 12:] = False  # the second rank has fewer supervised slots
    batch = {"hidden": torch.randn(4, seq, 3 * cfg.hidden_size),
             "input_ids": torch.randint(0, 90, (4, seq)), "loss_mask": loss_mask}
    anchors = torch.tensor([[1, 5, 9, 14]] * 4)
    valid = torch.tensor([[True] * 4] * 2 + [[True, True, False, False]] * 2)
    return module, batch, anchors, valid


def test_ddp_gradients_equal_one_big_batch_with_global_weight_normalisation(tmp_path):
    result = str(tmp_path / "grads.pt")
    torch.multiprocessing.spawn(_ddp_worker, args=(2, 29512, result), nprocs=2, join=True)
    module, batch, anchors, valid = _ddp_problem()
    out = module.blocks_loss(batch, anchors, valid)
    (out.weighted_sum / out.weight_sum).backward()
    want = torch.cat([p.grad.flatten() for p in module.drafter.parameters()])
    torch.testing.assert_close(torch.load(result, weights_only=True), want,
                               rtol=1e-5, atol=1e-7)


def test_build_drafter_refuses_bad_values(tiny_target_dir):
    with pytest.raises(ValueError, match="block_size"):
        build_drafter(config_target(tiny_target_dir), num_hidden_layers=1, block_size=1,
                      target_layer_ids=2)
    with pytest.raises(ValueError, match="missing drafter keys.*target_layer_ids"):
        build_drafter(config_target(tiny_target_dir), num_hidden_layers=1)


# ----------------------------------------------------------------------------- distribution
def test_a_distribution_loss_trains_and_exports_online_and_offline(tiny_target_dir, tmp_path):
    """issue 27's done-when: module.loss={kl: 1.0} on online data and on a capture made with
    capture.distribution=[last_hidden]; the argmax-only capture refuses it naming the option."""
    from dflash_lab.data.capture_loop import CaptureSettings, run_capture
    from dflash_lab.targets.demo_corpus import demo_conversations
    from dflash_lab.targets.loader import load_target
    from dflash_lab.train.run import train

    steps = {"trainer.max_epochs": 1, "trainer.max_steps": 4, "trainer.val_check_interval": 2,
             "trainer.log_every_n_steps": 1,
             "module.loss": "{kl: 1.0}", "export.enabled": True}
    online = _compose(_tiny_overrides(tmp_path / "online", tiny_target_dir, rows=32, **steps))
    result = train(online)
    assert (Path(result["export_dir"]) / "model.safetensors").is_file()
    metrics = next(Path(result["output_dir"]).rglob("metrics.csv")).read_text()
    assert "train/loss_kl" in metrics and "val/tau_T1" in metrics
    target = load_target(str(tiny_target_dir), dtype="float32", device="cpu")
    rows = [{"messages": c} for c in demo_conversations(24, seed=3)]
    for name, kinds in (("plain", ()), ("dist", ("last_hidden",)), ("topk", ("topk",))):
        run_capture(target, rows, CaptureSettings(str(tmp_path / name), [1, 3, 5], max_length=96,
                                                  shard_size=12, distribution=kinds),
                    {"path": "demo"}, progress=False)
    offline = {**steps, "data": "offline", "data.num_workers": 0,
               "~data.demo_rows": None, "~data.max_length": None}
    args = _tiny_overrides(tmp_path / "off", tiny_target_dir, **offline)
    args = [a.replace("=None", "") for a in args if not a.startswith(("data.demo_file",))]
    refused = _compose([*args, f"data.path={tmp_path / 'plain'}"])
    with pytest.raises(ValueError, match=r"recapture with capture.distribution=\[last_hidden\]"):
        build_components(refused)
    result = train(_compose([*args, f"data.path={tmp_path / 'dist'}"]))
    assert (Path(result["export_dir"]) / "model.safetensors").is_file()
    assert result["val_tau_after"] >= 1.0
    # a top-k capture trains at T = 1 and refuses another label temperature, naming the fix
    sparse = [a.replace(str(tmp_path / "off"), str(tmp_path / "off_topk")) for a in args]
    hot = _compose([*sparse, f"data.path={tmp_path / 'topk'}", "module.label_temperature=2.0"])
    with pytest.raises(ValueError, match=r"top-k at T = 1 only.*capture.distribution="):
        build_components(hot)
    result = train(_compose([*sparse, f"data.path={tmp_path / 'topk'}"]))
    assert (Path(result["export_dir"]) / "model.safetensors").is_file()
