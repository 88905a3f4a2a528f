"""Capture on the tiny target: round trip, resume after a crash, rank split + merge, entry point."""

from __future__ import annotations

import csv
import json
import logging

import pytest
import torch

from dflash_lab.data import shards
from dflash_lab.data.capture_loop import CaptureSettings, run_capture
from dflash_lab.targets.chat import tokenize_conversation
from dflash_lab.targets.demo_corpus import demo_conversations
from dflash_lab.targets.features import extract_features

LAYERS = [1, 3, 5]
ROWS = [{"messages": c} for c in demo_conversations(20, seed=7)]
SOURCE = {"path": "demo-seed7"}


def _settings(out_dir, **kw) -> CaptureSettings:
    base = dict(out_dir=str(out_dir), target_layer_ids=LAYERS, shard_size=6, batch_size=4,
                max_length=64)
    return CaptureSettings(**{**base, **kw})


def _checksums(manifest) -> list[str]:
    return [s["sha256"] for s in manifest["shards"]]


@pytest.fixture(scope="module")
def clean_capture(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    return out, run_capture(tiny_target, ROWS, _settings(out), SOURCE, progress=False)


def test_features_read_back_equal_a_fresh_forward(tiny_target, clean_capture):
    out, manifest = clean_capture
    assert manifest["num_samples"] == len(ROWS) and len(manifest["shards"]) == 4
    assert manifest["target_layer_ids"] == LAYERS
    assert manifest["hf_hidden_state_indices"] == [2, 4, 6]
    assert manifest["target"] == tiny_target.identity()
    ds = shards.ShardDataset(out, target_layer_ids=LAYERS, hidden_size=tiny_target.hidden_size,
                             vocab_size=tiny_target.vocab_size, target=tiny_target.identity(),
                             verify_checksums=True)
    for k in (0, 7, 19):
        item = ds[k]
        tc = tokenize_conversation(tiny_target.tokenizer, ROWS[k]["messages"], max_length=64)
        fresh = extract_features(tiny_target.model, tc.input_ids[None], LAYERS)
        assert item["sample_id"] == k
        assert torch.equal(item["input_ids"], tc.input_ids)
        assert torch.equal(item["loss_mask"], tc.loss_mask)
        assert torch.equal(item["target_argmax"], fresh.argmax_bs[0])
        ref = fresh.hidden_bsf[0].to(torch.bfloat16).float()
        assert torch.allclose(item["hidden"].float(), ref, rtol=1e-2, atol=1e-2)


def test_resume_after_a_crash_gives_identical_shards(tiny_target, clean_capture, tmp_path,
                                                     monkeypatch):
    real_write, calls = shards.write_shard, []

    def crashing_write(out_dir, index, samples, *args, **kwargs):
        calls.append(index)
        if len(calls) == 3:  # die mid-write: a half-written temporary file is left behind
            (tmp_path / (shards.shard_file(index) + ".tmp")).write_bytes(b"partial")
            raise KeyboardInterrupt("simulated kill")
        return real_write(out_dir, index, samples, *args, **kwargs)

    monkeypatch.setattr(shards, "write_shard", crashing_write)
    with pytest.raises(KeyboardInterrupt):
        run_capture(tiny_target, ROWS, _settings(tmp_path), SOURCE, progress=False)
    assert not (tmp_path / shards.MANIFEST_FILE).exists()
    done_before = (tmp_path / shards.shard_file(0)).stat().st_mtime_ns
    monkeypatch.setattr(shards, "write_shard", real_write)
    calls.clear()
    manifest = run_capture(tiny_target, ROWS, _settings(tmp_path), SOURCE, progress=False)
    assert _checksums(manifest) == _checksums(clean_capture[1])
    assert (tmp_path / shards.shard_file(0)).stat().st_mtime_ns == done_before  # skipped


def test_a_full_disk_is_named_with_what_was_kept_and_the_rerun_resumes(
        tiny_target, clean_capture, tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as a SafetensorError (no OSError): dflash-capture names
    it, keeps the finished shards, and the rerun gives the clean capture's shards."""
    from safetensors import SafetensorError

    from dflash_lab.capture import KEPT
    from dflash_lab.errors import user_errors

    real_save, calls = shards.save_file, []

    def disk_full(tensors, filename, *args, **kwargs):
        calls.append(filename)
        if len(calls) == 3:
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: '
                                  'StorageFull, message: "No space left on device" })')
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    monkeypatch.setattr(shards, "save_file", disk_full)
    with pytest.raises(SystemExit) as done, user_errors(KEPT):
        run_capture(tiny_target, ROWS, _settings(tmp_path), SOURCE, progress=False)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith("error: disk full: ")
    assert f"kept: {KEPT}" in err and "Traceback" not in err
    assert not list(tmp_path.glob("*.tmp-*"))  # no half-written shard
    monkeypatch.setattr(shards, "save_file", real_save)
    manifest = run_capture(tiny_target, ROWS, _settings(tmp_path), SOURCE, progress=False)
    assert _checksums(manifest) == _checksums(clean_capture[1])


def test_a_corrupt_shard_is_rewritten_on_rerun(tiny_target, clean_capture, tmp_path):
    run_capture(tiny_target, ROWS, _settings(tmp_path), SOURCE, progress=False)
    path = tmp_path / shards.shard_file(1)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="shard-00001.safetensors"):
        shards.ShardDataset(tmp_path)
    manifest = run_capture(tiny_target, ROWS, _settings(tmp_path), SOURCE, progress=False)
    assert _checksums(manifest) == _checksums(clean_capture[1])


def test_two_ranks_write_disjoint_shards_and_merge(tiny_target, clean_capture, tmp_path):
    first = run_capture(tiny_target, ROWS, _settings(tmp_path), SOURCE, rank=0, world_size=2,
                        progress=False)
    assert first is None  # rank 1's shards are missing
    written = sorted(p.name for p in tmp_path.glob("shard-*.safetensors"))
    assert written == [shards.shard_file(0), shards.shard_file(2)]
    merged = run_capture(tiny_target, ROWS, _settings(tmp_path), SOURCE, rank=1, world_size=2,
                         progress=False)
    assert _checksums(merged) == _checksums(clean_capture[1])
    assert merged["num_samples"] == len(ROWS)


def test_changed_settings_in_the_same_dir_are_refused(tiny_target, clean_capture):
    out, _ = clean_capture
    with pytest.raises(ValueError, match="max_length: existing=64 new=32"):
        run_capture(tiny_target, ROWS, _settings(out, max_length=32), SOURCE, progress=False)


def test_bad_inputs_are_refused(tiny_target, tmp_path):
    rows = ROWS[:2] + [{"messages": [{"role": "user", "content": "no answer"}]}]
    with pytest.raises(ValueError, match="demo-seed7 row 2: conversation has no assistant turn"
                                         ".*set capture.bad_rows=skip"):
        run_capture(tiny_target, rows, _settings(tmp_path, bad_rows="error"), SOURCE,
                    progress=False)
    with pytest.raises(ValueError, match="target_layer_ids"):
        run_capture(tiny_target, ROWS, _settings(tmp_path / "b", target_layer_ids=[0, 9]),
                    SOURCE, progress=False)
    with pytest.raises(ValueError, match="capture.bad_rows='drop'"):
        run_capture(tiny_target, ROWS, _settings(tmp_path / "c", bad_rows="drop"), SOURCE,
                    progress=False)


def test_samples_without_loss_tokens_after_truncation_are_dropped(tiny_target, tmp_path,
                                                                 caplog):
    with caplog.at_level(logging.WARNING):
        manifest = run_capture(tiny_target, ROWS[:6], _settings(tmp_path, max_length=8), SOURCE,
                               progress=False)
    assert manifest["num_samples"] == 0 and manifest["num_dropped"] == 6
    assert manifest["num_zero_loss_rows"] == 6 and manifest["zero_loss_rows"] == list(range(6))
    assert "6 rows have no loss token after truncation" in caplog.text
    assert len(shards.ShardDataset(tmp_path)) == 0


def test_manifest_reports_loss_tokens_per_sample(tiny_target, clean_capture):
    out, manifest = clean_capture
    ds = shards.ShardDataset(out)
    loss = [int(ds[k]["loss_mask"].sum()) for k in range(len(ds))]
    assert manifest["loss_tokens_per_sample"] == {
        "min": min(loss), "mean": sum(loss) / len(loss), "max": max(loss)}
    assert manifest["num_bad_rows"] == 0 and manifest["bad_rows"] == []
    assert manifest["num_zero_loss_rows"] == 0


# ------------------------------------------------------------------ bad rows and their reruns
BAD = {  # input-file row -> a row no chat template can train on
    3: {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                     {"role": "assistant", "content": "c"}]},
    7: {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": " "}]},
    10: {"messages": [{"role": "user", "content": "no answer"}]},
}
REASONS = {3: "roles do not alternate", 7: "is empty", 10: "no assistant turn"}


def _file_with_bad_rows(path, num: int = 14):
    """A JSONL file of ``num`` rows, the rows of BAD at their positions, demo rows elsewhere."""
    rows = [BAD.get(i, ROWS[i]) for i in range(num)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bad_rows_are_skipped_by_their_input_file_row(tiny_target, tmp_path):
    from dflash_lab.data.conversations import load_conversations

    data = load_conversations(str(_file_with_bad_rows(tmp_path / "d.jsonl")), shuffle_seed=3)
    assert data["input_row"] != list(range(len(data)))  # shuffled: positions are not rows
    manifest = run_capture(tiny_target, data, _settings(tmp_path / "cap"), SOURCE,
                           progress=False)
    assert sorted(b["row"] for b in manifest["bad_rows"]) == sorted(BAD)
    for bad in manifest["bad_rows"]:
        assert REASONS[bad["row"]] in bad["reason"]
    assert manifest["num_bad_rows"] == 3 and manifest["num_samples"] == 11
    assert manifest["num_dropped"] == 3
    first_bad = next(r for r in data["input_row"] if r in BAD)
    with pytest.raises(ValueError, match=f"d.jsonl row {first_bad}: .*{REASONS[first_bad]}"):
        run_capture(tiny_target, data, _settings(tmp_path / "err", bad_rows="error"),
                    {"path": str(tmp_path / "d.jsonl")}, progress=False)


def test_template_errors_are_bad_rows(tiny_target, tmp_path):
    import copy
    import dataclasses

    tok = copy.deepcopy(tiny_target.tokenizer)
    tok.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must "
                         "alternate user/assistant') }}{% endif %}" + tok.chat_template)
    strict = dataclasses.replace(tiny_target, tokenizer=tok)
    rows = ROWS[:5] + [{"messages": [{"role": "assistant", "content": "hi"},
                                     {"role": "user", "content": "a"},
                                     {"role": "assistant", "content": "b"}]}]
    manifest = run_capture(strict, rows, _settings(tmp_path), SOURCE, progress=False)
    assert [b["row"] for b in manifest["bad_rows"]] == [5]
    assert "chat template error: TemplateError: roles must alternate" in (
        manifest["bad_rows"][0]["reason"])
    with pytest.raises(ValueError, match="row 5: chat template error"):
        run_capture(strict, rows, _settings(tmp_path / "e", bad_rows="error"), SOURCE,
                    progress=False)


def test_a_shard_of_only_bad_rows_stops_the_capture(tiny_target, tmp_path):
    rows = [BAD[10]] * 6
    with pytest.raises(ValueError, match=r"all 6 rows of a shard are bad \(first: row 0: .*"
                                         "chat template"):
        run_capture(tiny_target, rows, _settings(tmp_path), SOURCE, progress=False)


def test_a_run_failed_before_any_shard_does_not_block_its_rerun(tiny_target, tmp_path):
    rows = ROWS[:4] + [BAD[3]] + ROWS[4:12]
    with pytest.raises(ValueError, match="row 4: roles do not alternate"):
        run_capture(tiny_target, rows, _settings(tmp_path, bad_rows="error"), SOURCE,
                    progress=False)
    assert (tmp_path / shards.PLAN_FILE).is_file()
    fixed = ROWS[:12]  # the user drops the bad row: another row count, so another plan
    manifest = run_capture(tiny_target, fixed, _settings(tmp_path, bad_rows="error"), SOURCE,
                           progress=False)
    assert manifest["num_samples"] == 12 and manifest["num_input_rows"] == 12


def test_a_run_failed_on_a_bad_row_resumes_with_skip(tiny_target, tmp_path):
    rows = ROWS[:14] + [BAD[3]] + ROWS[14:17]  # the bad row is in shard 2 (rows 12-17)
    with pytest.raises(ValueError, match="row 14: roles do not alternate"):
        run_capture(tiny_target, rows, _settings(tmp_path, bad_rows="error"), SOURCE,
                    progress=False)
    done = {i: (tmp_path / shards.shard_file(i)).stat().st_mtime_ns for i in (0, 1)}
    manifest = run_capture(tiny_target, rows, _settings(tmp_path, bad_rows="skip"), SOURCE,
                           progress=False)
    assert [b["row"] for b in manifest["bad_rows"]] == [14]
    assert manifest["num_samples"] == 17
    assert {i: (tmp_path / shards.shard_file(i)).stat().st_mtime_ns for i in (0, 1)} == done


def test_settings_changed_after_finished_shards_are_still_refused(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="row 14"):
        run_capture(tiny_target, ROWS[:14] + [BAD[3]], _settings(tmp_path, bad_rows="error"),
                    SOURCE, progress=False)
    with pytest.raises(ValueError, match="num_input_rows: existing=15 new=14"):
        run_capture(tiny_target, ROWS[:14], _settings(tmp_path), SOURCE, progress=False)


def test_a_plan_replaced_by_another_process_stops_the_rank(tiny_target, tmp_path, monkeypatch):
    from dflash_lab.data import capture_loop

    real = capture_loop.capture_shard

    def other_process_meddles(*args, **kwargs):
        plan = json.loads((tmp_path / shards.PLAN_FILE).read_text())
        shards.write_json_atomic(tmp_path / shards.PLAN_FILE, {**plan, "max_length": 32})
        return real(*args, **kwargs)

    monkeypatch.setattr(capture_loop, "capture_shard", other_process_meddles)
    with pytest.raises(ValueError, match="changed while this rank was capturing"):
        run_capture(tiny_target, ROWS, _settings(tmp_path), SOURCE, progress=False)
    assert not (tmp_path / shards.shard_record_file(0)).exists()


def test_entry_point_config_composes_and_runs(tiny_target_dir, tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from dflash_lab.capture import capture
    from dflash_lab.paths import CONF_DIR

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    out = tmp_path / "cap"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="capture", return_hydra_config=False, overrides=[
            f"target.path={tiny_target_dir}", f"capture.out_dir={out}", "data.limit=5",
            "data.demo_rows=16", f"data.demo_file={tmp_path / 'demo.jsonl'}",
            "capture.shard_size=4", "capture.progress=false", "logger=csv",
        ])
    manifest = capture(cfg)
    assert manifest["num_samples"] == 5
    with (out / "csv" / "version_0" / "metrics.csv").open() as f:  # logger=csv got the counts
        rows = list(csv.DictReader(f))
    assert [float(r["capture/num_samples"]) for r in rows] == [5]
    assert manifest["target_layer_ids"] == [1, 2, 3, 4, 5]  # build_target_layer_ids(8, 5)
    info = json.loads((out / "run_info.json").read_text())
    assert {"git_sha", "argv", "versions"} <= set(info) and "torch" in info["versions"]
    assert "target:" in (out / "config.yaml").read_text()
    cfg.capture.bad_rows = "drop"  # the setting reaches the capture loop
    with pytest.raises(ValueError, match="capture.bad_rows='drop'"):
        capture(cfg)


def test_rank_env_is_validated(monkeypatch):
    from dflash_lab.capture import rank_and_world

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK=2"):
        rank_and_world()
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert rank_and_world() == (0, 1)


def test_plain_srun_tasks_split_the_capture(monkeypatch):
    """``srun dflash-capture`` (no torchrun): SLURM's task ids are the ranks."""
    from dflash_lab.capture import rank_and_world

    for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "capture")
    assert rank_and_world() == (3, 4)


# ----------------------------------------------------------------------------- distribution
def test_the_target_distribution_is_captured_recorded_and_read_back(tiny_target, tmp_path,
                                                                   clean_capture):
    out = tmp_path / "dist"
    manifest = run_capture(tiny_target, ROWS[:8],
                           _settings(out, distribution=("last_hidden", "topk"),
                                     distribution_topk=5), SOURCE, progress=False)
    h, k = tiny_target.hidden_size, 5
    assert manifest["distribution"] == {"last_hidden": True, "topk": k}
    plain = clean_capture[1]
    assert "distribution" not in plain  # captures without the option keep their plan
    assert shards.distribution_of(plain) == {"last_hidden": False, "topk": 0}
    assert manifest["bytes_per_token"] == plain["bytes_per_token"] + 2 * h + 8 * k
    ds = shards.ShardDataset(out, verify_checksums=True)
    item = ds[3]
    tc = tokenize_conversation(tiny_target.tokenizer, ROWS[3]["messages"], max_length=64)
    fresh = extract_features(tiny_target.model, tc.input_ids[None], LAYERS, topk=k)
    assert torch.allclose(item["target_last_hidden"].float(),
                          fresh.last_bsh[0].to(torch.bfloat16).float())
    assert torch.equal(item["target_top_ids"].long(), fresh.top_ids_bsk[0])
    assert torch.equal(item["target_top_ids"][:, 0].long(), item["target_argmax"])
    logits = tiny_target.model(tc.input_ids[None]).logits[0].float()
    torch.testing.assert_close(item["target_top_logprobs"],
                               logits.log_softmax(-1).topk(k, dim=-1).values)
    assert "target_last_hidden" not in shards.ShardDataset(clean_capture[0])[0]


def test_a_bad_distribution_option_is_refused_naming_it(tiny_target, tmp_path):
    with pytest.raises(ValueError, match=r"capture.distribution=\['logits'\]"):
        run_capture(tiny_target, ROWS[:4], _settings(tmp_path, distribution=("logits",)),
                    SOURCE, progress=False)
    with pytest.raises(ValueError, match="capture.distribution_topk=0"):
        run_capture(tiny_target, ROWS[:4], _settings(tmp_path, distribution=("topk",),
                                                     distribution_topk=0), SOURCE,
                    progress=False)


def test_a_max_length_past_the_targets_context_is_warned(tiny_target, caplog):
    """capture.max_length beyond max_position_embeddings is named, not silently captured."""
    import logging

    from dflash_lab.capture import check_context

    limit = tiny_target.max_position_embeddings
    assert limit and check_context(tiny_target, limit)
    with caplog.at_level(logging.WARNING, logger="dflash_lab.capture"):
        assert not check_context(tiny_target, limit + 1)
    assert f"max_position_embeddings={limit}" in caplog.text
