"""Bad rows in online training data and in regeneration: reported by their input-file row,
skipped or fatal by setting (capture's are in test_capture.py)."""

from __future__ import annotations

import json
import logging

import pytest

from dflash_lab.data.module import OnlineDataModule
from dflash_lab.data.regenerate_loop import SETTINGS_FILE, RegenerateSettings, run_regenerate
from dflash_lab.targets.demo_corpus import demo_conversations

LAYERS = [1, 3, 5]
GOOD = [{"messages": c} for c in demo_conversations(12, seed=11)]
BAD = {  # input-file row -> why it cannot be trained on
    2: ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                      {"role": "assistant", "content": "c"}]}, "roles do not alternate"),
    6: ({"conversations": [{"from": "human", "value": " "}, {"from": "gpt", "value": "x"}]},
        "is empty"),
}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _file(tmp_path, num: int = 12):
    rows = [BAD[i][0] if i in BAD else GOOD[i] for i in range(num)]
    return str(_jsonl(tmp_path / "conv.jsonl", rows))


def _online(tiny_target, path, **kw) -> OnlineDataModule:
    return OnlineDataModule(path, tiny_target, LAYERS, max_length=64, batch_size=4,
                            val_fraction=0.25, seed=0, **kw)


def test_online_data_skips_bad_rows_by_file_row_and_reports_loss_tokens(tiny_target, tmp_path,
                                                                        caplog):
    dm = _online(tiny_target, _file(tmp_path), shuffle_seed=5)
    with caplog.at_level(logging.WARNING):
        dm.setup("fit")
    assert sorted(b["row"] for b in dm.report["bad_rows"]) == sorted(BAD)
    for bad in dm.report["bad_rows"]:
        assert BAD[bad["row"]][1] in bad["reason"]
        assert f"conv.jsonl row {bad['row']} skipped" in caplog.text
    assert dm.report["num_samples"] == len(dm.train_set) + len(dm.val_set) == 10
    loss = [int(dm.train_set[k]["loss_mask"].sum()) for k in range(len(dm.train_set))]
    per = dm.report["loss_tokens_per_sample"]
    assert per["min"] <= min(loss) and per["max"] >= max(loss) and per["min"] >= 2


def test_online_data_bad_rows_error_names_the_file_row_and_setting(tiny_target, tmp_path):
    path = _file(tmp_path)
    with pytest.raises(ValueError, match=r"conv.jsonl row (2|6): .*data.bad_rows=skip"):
        _online(tiny_target, path, bad_rows="error").setup("fit")
    with pytest.raises(ValueError, match="data.bad_rows='ignore'"):
        _online(tiny_target, path, bad_rows="ignore")


def test_online_data_warns_on_rows_without_loss_tokens(tiny_target, tmp_path, caplog):
    path = str(_jsonl(tmp_path / "c.jsonl", GOOD[:4]))
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="fewer than 2"):
        OnlineDataModule(path, tiny_target, LAYERS, max_length=6, batch_size=2).setup("fit")
    assert "4 rows have no loss token after truncation" in caplog.text


def test_regeneration_skips_bad_rows_and_the_setting_is_not_part_of_the_resume_check(
        tiny_target, tmp_path, caplog):
    from dflash_lab.data.conversations import load_conversations

    data = load_conversations(_file(tmp_path, num=8), shuffle_seed=1)
    kw = dict(max_new_tokens=4, part_size=4, batch_size=4)
    with pytest.raises(ValueError, match=r"input row (2|6): .*regenerate.settings.bad_rows=skip"):
        run_regenerate(tiny_target, data, RegenerateSettings(str(tmp_path / "r"), bad_rows="error",
                                                             **kw), {"path": "x"},
                       progress=False)
    assert "bad_rows" not in json.loads((tmp_path / "r" / SETTINGS_FILE).read_text())["settings"]
    with caplog.at_level(logging.WARNING):
        manifest = run_regenerate(tiny_target, data, RegenerateSettings(str(tmp_path / "r"), **kw),
                                  {"path": "x"}, progress=False)
    assert manifest["num_conversations"] == 6 and manifest["dropped"] == 2
    assert "input row 2 skipped: roles do not alternate" in caplog.text
    assert "input row 6 skipped" in caplog.text
    with pytest.raises(ValueError, match="regenerate.settings.bad_rows='x'"):
        RegenerateSettings("unused", bad_rows="x")
