"""speculators offline data read as our offline data source (issue 29, item 4): the items equal
our in-process capture of the same rows, auto-detection, the refusals, and a dflash-train run."""

import csv
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_lab.data.speculators_data import SpeculatorsDataset, detect_format, hs_file
from dflash_lab.targets.features import extract_features
from tests.data import speculators_fixture as fx

#: their ids on the tiny target (8 layers): ours 1, 3, 5 exactly, 7 derived from 8 (last, pre-norm)
THEIR_IDS = [2, 4, 6, 8]
OUR_IDS = [1, 3, 5, 7]
SPECULATORS_VENV = Path("/work/main/.venv-speculators")


@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory, tiny_target):
    """A speculators directory of 12 rows whose states come from the tiny target."""
    out = tmp_path_factory.mktemp("spec") / "data"
    rows = fx.write_dataset(out, tiny_target, THEIR_IDS)
    return out, rows


def _reader(path, target, ids=OUR_IDS, **kw):
    return SpeculatorsDataset(path, target=target, target_layer_ids=ids,
                              layer_ids=kw.pop("layer_ids", THEIR_IDS), **kw)


def test_items_equal_our_in_process_capture_of_the_same_rows(spec_dir, tiny_target):
    """The layer mapping (theirs = ours + 1; our last = final_norm(their L)) gives exactly the
    features our capture computes, and argmax / last hidden derived from their last state."""
    path, rows = spec_dir
    data = _reader(path, tiny_target)
    assert len(data) == len(rows) and data.lengths() == [len(r["input_ids"]) for r in rows]
    for k in (0, 5, 11):
        item, row = data[k], rows[k]
        ids = torch.tensor([row["input_ids"]])
        ours = extract_features(tiny_target.model, ids, OUR_IDS)
        assert item["sample_id"] == k
        assert torch.equal(item["input_ids"], ids[0])
        assert torch.equal(item["loss_mask"], torch.tensor(row["loss_mask"]).bool())
        torch.testing.assert_close(item["hidden"], ours.hidden_bsf[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(item["target_last_hidden"], ours.last_bsh[0])
        assert torch.equal(item["target_argmax"], ours.argmax_bs[0])
    # the off-by-one is real: their state at our id (not + 1) is not our feature, and their last
    # (pre-norm) state is not our last layer's
    states = fx.vllm_convention_states(tiny_target.model, rows[0]["input_ids"], [3, 8])
    ours = extract_features(tiny_target.model, torch.tensor([rows[0]["input_ids"]]), [3, 7])
    H = tiny_target.hidden_size
    assert not torch.allclose(states[:, 0], ours.hidden_bsf[0, :, :H], atol=1e-3)
    assert not torch.allclose(states[:, 1], ours.hidden_bsf[0, :, H:], atol=1e-3)
    assert data.manifest["distribution"] == {"last_hidden": True, "topk": 0}


def test_a_subset_of_layers_in_another_order_and_fp8_files(tmp_path, spec_dir, tiny_target):
    path, rows = spec_dir
    item = _reader(path, tiny_target, ids=[5, 1])[2]
    full = _reader(path, tiny_target)[2]["hidden"]
    H = tiny_target.hidden_size
    assert torch.equal(item["hidden"], torch.cat([full[:, 2 * H:3 * H], full[:, :H]], -1))
    fx.write_rows(tmp_path / "fp8", rows[:3])
    fx.write_states(tmp_path / "fp8", tiny_target.model, rows[:3], THEIR_IDS, fp8=True)
    fp8 = _reader(tmp_path / "fp8", tiny_target)[1]
    assert fp8["hidden"].dtype == torch.bfloat16
    exact = _reader(path, tiny_target)[1]["hidden"]
    torch.testing.assert_close(fp8["hidden"].float(), exact, rtol=0.13, atol=0.02)  # e4m3


def test_rows_without_a_states_file_are_left_out(tmp_path, tiny_target, caplog):
    rows = fx.token_rows(tiny_target, 5)
    fx.write_rows(tmp_path / "d", rows)
    fx.write_states(tmp_path / "d", tiny_target.model, rows, THEIR_IDS, skip=(1, 3))
    with caplog.at_level("WARNING"):
        data = _reader(tmp_path / "d", tiny_target)
    assert [data[k]["sample_id"] for k in range(len(data))] == [0, 2, 4]
    assert "2 of 5 rows have no hs_<row>.safetensors" in caplog.text


def test_auto_detection_and_directories_that_are_neither(tmp_path, spec_dir):
    path, _ = spec_dir
    assert detect_format(path) == "speculators"
    assert detect_format(path, "speculators") == "speculators"
    capture = tmp_path / "capture"
    capture.mkdir()
    (capture / "manifest.json").write_text("{}")
    assert detect_format(capture) == "dflash_lab"
    with pytest.raises(ValueError, match=rf"data.path={capture} has no dataset_info.json and "
                                         r"state.json \(a speculators prepare-data output"):
        detect_format(capture, "speculators")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=rf"data.path={empty} has no manifest.json .* or "
                                         r"dataset_info.json and state.json"):
        detect_format(empty)
    with pytest.raises(ValueError, match=r"\(does not exist\) has no manifest.json"):
        detect_format(tmp_path / "nowhere")
    both = tmp_path / "both"
    shutil.copytree(path, both)
    (both / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match="holds both .* set data.format=dflash_lab or speculators"):
        detect_format(both)
    with pytest.raises(ValueError, match=r"data.format='hf': use one of"):
        detect_format(path, "hf")


@pytest.mark.parametrize(("kw", "message"), [
    ({"ids": [2, 5]}, r"layer 2 \(their id 3\) is not in the speculators data "
                      r"\(data.speculators_layer_ids=\[2, 4, 6, 8\]\)"),
    ({"layer_ids": [2, 4, 6]}, r"has no last layer 8: .* --include-last-layer"),
    ({"layer_ids": [2, 4, 6, 7, 8]}, r"hidden_states has shape \[\d+, 4, 64\] but \[\d+, 5, 64\] "
                                     r".* check data.speculators_layer_ids"),
    ({"layer_ids": [2, 2, 8]}, r"need distinct ids in \[0, 8\]"),
    ({"hidden_size": 32}, r"the drafter expects hidden_size=32 but the target has 64"),
    # their states are vLLM's aux hidden states: H per layer (a multi-stream target's mean)
    ({"target_hidden_size": 256}, r"the drafter expects target_hidden_size=256 but the target "
                                  r"has 64"),
    ({"hidden_states_path": "/nonexistent/hs"}, r"no hidden-states directory"),
])
def test_what_cannot_be_used_is_refused_naming_the_field(spec_dir, tiny_target, kw, message):
    path, _ = spec_dir
    with pytest.raises(ValueError, match=message):
        _reader(path, tiny_target, **kw)


def test_states_of_other_rows_are_refused(tmp_path, spec_dir, tiny_target):
    """A file whose token ids are not its row's (another prepare-data output's states)."""
    path, rows = spec_dir
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    ids = torch.tensor(rows[4]["input_ids"][::-1], dtype=torch.int64)
    save_file({"hidden_states": torch.zeros(len(ids), len(THEIR_IDS), tiny_target.hidden_size),
               "token_ids": ids}, str(bad / "hidden_states" / hs_file(4)))
    with pytest.raises(ValueError, match=r"hs_4.safetensors: token_ids are not row 4's input_ids"):
        _reader(bad, tiny_target)


# ----------------------------------------------------------------------------- dflash-train
def test_dflash_train_trains_on_a_speculators_directory(tmp_path, spec_dir, tiny_target_dir):
    """data=offline on a speculators directory (auto-detected), a distribution loss included
    (their last state gives target_last_hidden): the loss falls and the run validates."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dflash_lab.paths import CONF_DIR
    from dflash_lab.train.run import train

    path, _ = spec_dir
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "recipe=tiny_cpu", "data=offline", f"data.path={path}",
            "~data.demo_rows", "~data.max_length",
            f"data.speculators_layer_ids=[{','.join(map(str, THEIR_IDS))}]",
            f"target.path={tiny_target_dir}", "drafter.target_layer_ids=[1,3,5,7]",
            f"paths.output_dir={tmp_path / 'run'}", "logger=csv", "export.enabled=false",
            "data.batch_size=3", "data.val_fraction=0.25", "data.num_workers=0",
            "trainer.max_epochs=3", "trainer.val_check_interval=1.0",
            "trainer.log_every_n_steps=1", "module.loss={ce: 1.0, kl: 1.0}"])
    result = train(cfg)
    with next(Path(result["output_dir"]).rglob("metrics.csv")).open() as f:
        losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(losses) >= 6 and all(map(math.isfinite, losses))
    assert sum(losses[-3:]) < sum(losses[:3])
    assert result["val_tau_after"] >= 1.0


# ----------------------------------------------------------------------------- their own code
@pytest.mark.skipif(not (SPECULATORS_VENV / "bin" / "speculators").is_file(),
                    reason=f"needs speculators 0.9.0's venv at {SPECULATORS_VENV} "
                           "(make speculators-venv)")
def test_their_prepare_data_output_and_their_reader_agree_with_ours(tmp_path, tiny_target,
                                                                     tiny_target_dir):
    """speculators' own prepare-data writes the rows (their shuffle decides the row order), the
    states are written for their rows, their own ArrowDataset reads them: same as ours."""
    rows = fx.token_rows(tiny_target, 6)
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = tmp_path / "prepared"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([str(SPECULATORS_VENV / "bin" / "speculators"), "prepare-data", "--model",
                    str(tiny_target_dir), "--data", str(src), "--output", str(data),
                    "--seq-length", "64", "--num-preprocessing-workers", "1"],
                   check=True, env=env, capture_output=True, timeout=300)
    from datasets import load_from_disk

    theirs = load_from_disk(str(data)).with_format(None)
    their_rows = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in theirs]
    assert sorted(map(str, their_rows)) == sorted(map(str, rows))  # same rows, their order
    fx.write_states(data, tiny_target.model, their_rows, THEIR_IDS)
    dump = tmp_path / "theirs.safetensors"
    subprocess.run([str(SPECULATORS_VENV / "bin" / "python"),
                    str(Path(__file__).with_name("speculators_side.py")), str(data), str(dump),
                    "64"], check=True, env=env, capture_output=True, timeout=300)
    ours = _reader(data, tiny_target)
    H = tiny_target.hidden_size
    with safe_open(str(dump), framework="pt") as f:
        for k in range(len(ours)):
            item = ours[k]
            assert torch.equal(f.get_tensor(f"{k}.input_ids"), item["input_ids"])
            assert torch.equal(f.get_tensor(f"{k}.loss_mask").bool(), item["loss_mask"])
            # their aux layers (2, 4, 6) are our 1, 3, 5; their last, normed, is our 7
            assert torch.equal(f.get_tensor(f"{k}.hidden_states"), item["hidden"][:, :3 * H])
            normed = ours.norm(f.get_tensor(f"{k}.verifier_last"))
            assert torch.equal(normed, item["hidden"][:, 3 * H:])
