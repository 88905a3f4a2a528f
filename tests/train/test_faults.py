"""Faults and hostile inputs (issue 16): what must never happen, whatever the input."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.paths import CONF_DIR


class _Payload:
    """Unpickling this object creates a file: proof that pickled code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("ckpt_path", ["auto", "given"])
def test_resume_never_runs_a_pickle_payload(tmp_path, tiny_target_dir, monkeypatch, caplog,
                                            ckpt_path):
    """Resume loads last.ckpt with weights_only=True explicitly, so even
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 cannot make a planted checkpoint execute code: a given
    ``ckpt_path`` is refused, ``auto`` sets it aside as unloadable and starts fresh."""
    from dflash_lab.train.run import train

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    marker = tmp_path / "pwned"
    torch.save({"state_dict": {}, "payload": _Payload(marker)}, run / "checkpoints" / "last.ckpt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "recipe=tiny_cpu", f"target.path={tiny_target_dir}", f"paths.output_dir={run}",
            "logger=none", "export.enabled=false", "data.demo_rows=24",
            f"data.demo_file={tmp_path / 'demo.jsonl'}", "data.max_length=64",
            "trainer.max_epochs=1", "validate_before_fit=false",
            "ckpt_path=" + ("auto" if ckpt_path == "auto" else
                            str(run / "checkpoints" / "last.ckpt"))])
    if ckpt_path == "auto":
        with caplog.at_level("WARNING"):
            train(cfg)
        assert "Weights only load failed" in caplog.text
    else:
        with pytest.raises(Exception, match="(?i)weights.only"):
            train(cfg)
    assert not marker.exists()


# ------------------------------------------------------------- item 3: the target's weights
def _other_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of the target directory whose weights are all nudged (a fine-tune's shape:
    same config, tokenizer and tensor shapes, other values)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in tensors.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def weights_capture(tiny_target, tiny_target_dir, tmp_path_factory):
    """A 4-row capture of the tiny target and a loaded other checkpoint of the same config."""
    from dflash_lab.data.capture_loop import CaptureSettings, run_capture
    from dflash_lab.targets.demo_corpus import demo_conversations
    from dflash_lab.targets.loader import load_target

    root = tmp_path_factory.mktemp("weights")
    rows = [{"messages": c} for c in demo_conversations(4, seed=3)]
    settings = CaptureSettings(out_dir=str(root / "cap"), target_layer_ids=[1, 3],
                               shard_size=4, batch_size=4, max_length=48)
    run_capture(tiny_target, rows, settings, {"path": "demo"}, progress=False)
    other = load_target(str(_other_checkpoint(tiny_target_dir, root / "other")),
                        dtype="float32", device="cpu", head_only=True)
    return root / "cap", other


def test_capture_of_another_checkpoint_is_refused_naming_both_fingerprints(
        tiny_target, weights_capture):
    from dflash_lab.data.shards import ShardDataset

    cap, other = weights_capture
    mine, theirs = tiny_target.weights_fingerprint(), other.weights_fingerprint()
    assert mine and theirs and mine != theirs
    with pytest.raises(ValueError, match=f"(?s){mine[:16]}.*{theirs[:16]}.*"
                                         "allow_other_target_weights=true"):
        ShardDataset(cap, target=other.identity())
    assert len(ShardDataset(cap, target=other.identity(), allow_other_weights=True)) == 4
    assert len(ShardDataset(cap, target=tiny_target.identity())) == 4


def test_manifest_without_a_fingerprint_warns_and_is_used(tiny_target, weights_capture,
                                                          tmp_path, caplog):
    import json
    import shutil

    from dflash_lab.data.shards import SEAL_KEY, ShardDataset

    old = tmp_path / "old"
    shutil.copytree(weights_capture[0], old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["target"]["weights_fingerprint"]
    del manifest[SEAL_KEY]  # a manifest from before the fingerprint predates the seal too
    (old / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level("WARNING"):
        assert len(ShardDataset(old, target=tiny_target.identity())) == 4
    assert "no target weights fingerprint" in caplog.text


def test_fingerprint_is_one_for_full_head_only_and_hub_cache_loads(
        tiny_target, tiny_target_dir, offline_hf_cache):
    from dflash_lab.targets.loader import load_target
    from tests.stand_ins import publish_to_hf_cache

    publish_to_hf_cache(tiny_target_dir, "Org/Tiny", offline_hf_cache)
    loads = [load_target(str(tiny_target_dir), dtype="float32", device="cpu", head_only=True),
             load_target("Org/Tiny", dtype="float32", device="cpu", head_only=True),
             load_target("Org/Tiny", dtype="float32", device="cpu")]
    want = tiny_target.weights_fingerprint()
    assert want is not None
    assert [t.weights_fingerprint() for t in loads] == [want] * 3


# ------------------------------------------------------------------ item 8: corrupt bytes
def test_a_flipped_byte_in_a_shard_is_an_error_naming_it_by_default(weights_capture,
                                                                    tmp_path):
    """Default ``verify_checksums=first_use``: the shard's sha256 is checked when a process
    first reads it (same size, so only the hash can tell)."""
    import shutil

    from dflash_lab.data.shards import ShardDataset

    cap = tmp_path / "cap"
    shutil.copytree(weights_capture[0], cap)
    shard = cap / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's data, past the header
    shard.write_bytes(bytes(data))
    ds = ShardDataset(cap)
    with pytest.raises(ValueError, match="shard-00000.safetensors: checksum mismatch"):
        ds[0]
    with pytest.raises(ValueError, match="shard-00000.safetensors: checksum mismatch"):
        ShardDataset(cap, verify_checksums=True)
    assert ShardDataset(cap, verify_checksums=False)[0]["sample_id"] >= 0


# ------------------------------------------------- items 4-7: training runs and their resume
def _train_cfg(tmp_path: Path, target_dir: Path, run: Path, **extra):
    """The tiny recipe at toy size: 24 demo rows, 3 steps an epoch, one validation each."""
    base = {"recipe": "tiny_cpu", "target.path": target_dir, "paths.output_dir": run,
            "logger": "none", "export.enabled": False, "data.demo_rows": 24,
            "data.demo_file": tmp_path / "demo.jsonl", "data.max_length": 64,
            "data.batch_size": 6, "data.val_fraction": 0.25, "trainer.max_epochs": 2,
            "validate_before_fit": False, "callbacks.checkpoint.last_every_n_steps": "null",
            "callbacks.progress": "null"}
    base.update(extra)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[f"{k}={v}" for k, v in base.items()])


@pytest.fixture(scope="module")
def trained_run(tiny_target_dir, tmp_path_factory):
    """A finished 2-epoch run (last.ckpt, last.prev.ckpt, a best checkpoint, records)."""
    from dflash_lab.train.run import train

    root = tmp_path_factory.mktemp("trained")
    train(_train_cfg(root, tiny_target_dir, root / "run"))
    return root / "run"


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _step(ckpt: Path) -> int:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_run_records_its_target_weights_in_run_info_and_every_checkpoint(
        trained_run, tiny_target):
    import json

    want = tiny_target.weights_fingerprint()
    info = json.loads((trained_run / "run_info.json").read_text())
    assert info["target"]["weights_fingerprint"] == want
    for ckpt in (trained_run / "checkpoints").glob("*.ckpt"):
        saved = torch.load(ckpt, map_location="cpu", weights_only=True)["dflash_target"]
        assert saved["weights_fingerprint"] == want, ckpt.name


def test_a_copied_run_directory_resumes_its_own_copy(trained_run, tiny_target_dir, tmp_path):
    """ckpt_path=auto in a copy: resumes the copy's last.ckpt, saves to the same last.ckpt
    (no last-v1.ckpt split), its best checkpoint lies in the copy; the original is untouched."""
    from dflash_lab.train.run import train

    before = _snapshot(trained_run)
    copy = _copy(trained_run, tmp_path / "copy")
    steps = _step(copy / "checkpoints/last.ckpt")
    result = train(_train_cfg(tmp_path, tiny_target_dir, copy, **{"trainer.max_epochs": 3}))
    assert Path(result["best_checkpoint"]).parent == (copy / "checkpoints").resolve()
    assert sorted(p.name for p in (copy / "checkpoints").glob("last*.ckpt")) == [
        "last.ckpt", "last.prev.ckpt"]
    assert _step(copy / "checkpoints/last.ckpt") == steps * 3 // 2  # continued, not redone
    assert _snapshot(trained_run) == before


def test_a_moved_run_directory_resumes_where_it_is_now(tiny_target_dir, tmp_path):
    """The old directory is gone: no FileNotFoundError for the stale best/last paths."""
    import shutil

    from dflash_lab.train.run import train

    train(_train_cfg(tmp_path, tiny_target_dir, tmp_path / "old", **{"trainer.max_epochs": 1}))
    moved = Path(shutil.move(tmp_path / "old", tmp_path / "moved"))
    result = train(_train_cfg(tmp_path, tiny_target_dir, moved, **{"trainer.max_epochs": 2}))
    assert Path(result["best_checkpoint"]).parent == (moved / "checkpoints").resolve()
    assert not list(moved.glob("checkpoints/last-v*.ckpt"))
    assert _step(moved / "checkpoints/last.ckpt") == 2 * _step(moved / "checkpoints/last.prev.ckpt")


# ------------------------------------------------------------------- item 5: a full disk
def test_a_full_disk_during_a_save_keeps_the_resume_point(trained_run, tiny_target_dir,
                                                          tmp_path, monkeypatch, capsys):
    """The writer fails half way through last.ckpt (what a full disk does to a copy from
    $TMPDIR): the old last.ckpt is intact, no temporary file is left, and the rerun resumes."""
    import errno

    import dflash_lab.train.callbacks as callbacks
    from dflash_lab.errors import user_errors
    from dflash_lab.train.cli import KEPT
    from dflash_lab.train.run import train

    run = _copy(trained_run, tmp_path / "run")
    last = run / "checkpoints/last.ckpt"
    intact, steps = last.read_bytes(), _step(last)
    real = callbacks.write_checkpoint_file

    def disk_full(checkpoint, filepath):
        if "last" not in Path(filepath).name:
            return real(checkpoint, filepath)
        import io

        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        Path(filepath).write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(filepath))

    monkeypatch.setattr(callbacks, "write_checkpoint_file", disk_full)
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as done, user_errors(KEPT):  # as dflash-train reports it
        train(_train_cfg(tmp_path, tiny_target_dir, run, **{"trainer.max_epochs": 3}))
    err = capsys.readouterr().err.splitlines()[-2]  # after the progress bars
    assert done.value.code == 2 and err.startswith("error: disk full: writing ")
    assert f"kept: {KEPT}" in err and "Traceback" not in err
    assert last.read_bytes() == intact
    assert not list(run.glob("checkpoints/.*.tmp"))
    monkeypatch.setattr(callbacks, "write_checkpoint_file", real)
    train(_train_cfg(tmp_path, tiny_target_dir, run, **{"trainer.max_epochs": 3}))
    assert _step(last) == steps * 3 // 2


def test_checkpoints_are_staged_beside_their_target_not_in_the_system_temp_folder(
        tmp_path, monkeypatch):
    """Lightning's own save writes a file in the system temp folder first (fsspec): here every
    temporary file outside the checkpoint's folder fails, as a full or read-only $TMPDIR
    does, and the checkpoints are still written."""
    import errno
    import tempfile

    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    from dflash_lab.train.callbacks import DFlashCheckpoint

    def no_temp(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", tempfile.gettempdir())

    monkeypatch.setattr(tempfile, "mkstemp", no_temp)
    monkeypatch.setattr(tempfile, "mkdtemp", no_temp)
    checkpoints = tmp_path / "checkpoints"
    trainer = L.Trainer(max_steps=4, limit_val_batches=1, val_check_interval=2,
                        accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[DFlashCheckpoint(dirpath=checkpoints, monitor=None,
                                                    save_last=True)])
    trainer.fit(BoringModel())
    assert _step(checkpoints / "last.ckpt") == 4
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "truncated, no sidecar"])
def test_a_damaged_last_ckpt_is_detected_and_the_previous_one_used(trained_run, tmp_path,
                                                                   caplog, damage):
    from dflash_lab.train.resume import resolve_ckpt_path

    run = _copy(trained_run, tmp_path / "run")
    last = run / "checkpoints/last.ckpt"
    data = bytearray(last.read_bytes())
    if damage.startswith("truncated"):
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01
    last.write_bytes(bytes(data))
    if "no sidecar" in damage:  # a run from before checksums: torch.load must fail
        (run / "checkpoints/last.ckpt.sha256").unlink()
    with caplog.at_level("WARNING"):
        got = resolve_ckpt_path("auto", run)
    assert got == str(run / "checkpoints/last.prev.ckpt")
    assert "last.ckpt" in caplog.text and "previous checkpoint" in caplog.text
    assert not last.exists() and list(run.glob("checkpoints/last.ckpt.corrupt-*"))
    with pytest.raises(ValueError, match="ckpt_path=.*last.prev.ckpt.*sha256"):
        prev = run / "checkpoints/last.prev.ckpt"
        data = bytearray(prev.read_bytes())
        data[len(data) // 2] ^= 0x01
        prev.write_bytes(bytes(data))
        resolve_ckpt_path(str(prev), run)


# --------------------------------------------------- items 6, 7: changed config, the record
@pytest.mark.parametrize("change", [{"module.gamma": 2.5}, {"drafter.block_size": 4},
                                    {"data.max_length": 48}])
def test_a_resume_with_changed_settings_is_refused_and_the_record_kept(
        trained_run, tiny_target_dir, tmp_path, change):
    from dflash_lab.train.run import train

    run = _copy(trained_run, tmp_path / "run")
    before = _snapshot(run)
    key = next(iter(change))
    with pytest.raises(ValueError, match=f"{key}: .* -> .*resume_allow_changes"):
        train(_train_cfg(tmp_path, tiny_target_dir, run, **change))
    assert _snapshot(run) == before  # config.yaml, run_info.json, checkpoints: as they were


def test_resume_changes_are_accepted_when_named_or_forced(trained_run, tiny_target_dir,
                                                          tmp_path):
    from dflash_lab.train.resume import resolve_ckpt_path
    from dflash_lab.train.run import check_resume

    ckpt = resolve_ckpt_path("auto", trained_run)
    changed = {"module.optimizer.lr": 1e-4, "data.num_workers": 1, "trainer.max_epochs": 9}
    with pytest.raises(ValueError, match=r"module.optimizer.lr: 0.\d+ -> 0.0001"):
        check_resume(_train_cfg(tmp_path, tiny_target_dir, trained_run, **changed),
                     trained_run, ckpt)
    for extra in ({"resume_allow_changes": "[module.optimizer]"}, {"resume_force": True}):
        check_resume(_train_cfg(tmp_path, tiny_target_dir, trained_run, **changed, **extra),
                     trained_run, ckpt)


def test_a_resume_with_another_checkpoint_of_the_target_is_refused(
        trained_run, tiny_target_dir, weights_capture, tmp_path):
    from dflash_lab.train.run import train

    run = _copy(trained_run, tmp_path / "run")
    before = _snapshot(run)
    other_dir = Path(weights_capture[1].name_or_path)
    with pytest.raises(ValueError, match="target.path: "):  # another file: a config change
        train(_train_cfg(tmp_path, other_dir, run))
    with pytest.raises(ValueError, match="(?s)target weights .* has weights .*"
                                         "resume_allow_changes=.target.weights_fingerprint"):
        train(_train_cfg(tmp_path, other_dir, run, resume_allow_changes="[target.path]"))
    assert _snapshot(run) == before


def test_a_refused_capture_keeps_the_directory_record(tiny_target_dir, tmp_path):
    from dflash_lab.capture import capture

    def cfg(max_length):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="capture", overrides=[
                f"target.path={tiny_target_dir}", f"capture.out_dir={tmp_path / 'cap'}",
                "data.limit=4", "data.demo_rows=8", f"data.demo_file={tmp_path / 'd.jsonl'}",
                "capture.shard_size=4", "capture.progress=false", "logger=none",
                f"capture.max_length={max_length}"])

    capture(cfg(48))
    before = _snapshot(tmp_path / "cap")
    with pytest.raises(ValueError, match="max_length"):
        capture(cfg(32))
    assert _snapshot(tmp_path / "cap") == before


# -------------------------------------------------------- item 8: a corrupt checkpoint
def test_the_exporter_refuses_a_checkpoint_whose_checksum_fails(trained_run, tmp_path):
    from dflash_lab.export import export_drafter

    run = _copy(trained_run, tmp_path / "run")
    best = next(run.glob("checkpoints/best-*.ckpt"))
    assert (best.parent / (best.name + ".sha256")).is_file()
    data = bytearray(best.read_bytes())
    data[len(data) // 2] ^= 0x01
    best.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{best.name}: sha256 .* does not match"):
        export_drafter(best, tmp_path / "out", engine="vllm")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------- item 9: bad values found at start-up
def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create files in: a read-only tmp dir for a normal user;
    for root (who writes through permission bits) a directory of the read-only /proc."""
    import os

    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        return ro
    return Path(f"/proc/{os.getpid()}")


@pytest.mark.parametrize(("override", "message"), [
    ({"module.num_anchors": 0}, r"module.num_anchors=0: must be >= 1"),
    ({"drafter.block_size": 80}, r"drafter.block_size=80 is longer than the sequences "
                                 r"\(data.max_length=64\)"),
    ({"data": "offline"}, "data.path is not set"),
    ({"callbacks.checkpoint.dirpath": "UNWRITABLE/checkpoints"}, "is not a writable directory"),
])
def test_bad_values_are_refused_before_any_work(tiny_target_dir, tmp_path, monkeypatch,
                                                override, message):
    """Each is refused by train() before the target loads (the loader would fail the test)
    and before the run directory exists."""
    import dflash_lab.targets.loader as loader
    from dflash_lab.train.run import train

    if "callbacks.checkpoint.dirpath" in override:
        override = {"callbacks.checkpoint.dirpath": f"{_unwritable_dir(tmp_path)}/checkpoints"}
    monkeypatch.setattr(loader, "load_target", lambda *a, **k: pytest.fail("target loaded"))
    if override.get("data") == "offline":  # no recipe: tiny_cpu sets online data keys
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="train", overrides=[
                "data=offline", "logger=none", f"target.path={tiny_target_dir}",
                f"paths.output_dir={tmp_path / 'run'}"])
    else:
        cfg = _train_cfg(tmp_path, tiny_target_dir, tmp_path / "run", **override)
    with pytest.raises(ValueError, match=message):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_a_user_error_exits_2_with_one_line_and_no_traceback(tiny_target_dir, tmp_path):
    import os
    import subprocess
    import sys

    from dflash_lab.paths import REPO_ROOT

    args = [sys.executable, "-m", "dflash_lab.train.cli", "recipe=tiny_cpu", "logger=none",
            f"target.path={tiny_target_dir}", f"paths.output_dir={tmp_path / 'run'}",
            "module.num_anchors=0"]
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "DFLASH_DEBUG")}
    done = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: module.num_anchors=0: must be >= 1" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / "run").exists()  # Hydra no longer makes paths.output_dir first
    debug = subprocess.run(args, cwd=REPO_ROOT, env={**env, "DFLASH_DEBUG": "1"},
                           capture_output=True, text=True, timeout=300)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


# ------------------------------------------- item 10: data errors that name the place
@pytest.mark.parametrize(("line3", "message"), [
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "line 3: not UTF-8"),
    (b'{"messages": [{"role": "user", "content": "hi"}', "line 3: malformed JSON"),
])
def test_a_bad_jsonl_line_is_named_by_file_and_line(tmp_path, line3, message):
    from dflash_lab.data.conversations import load_conversations

    good = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", ' \
           b'"content": "hello"}]}'
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join([good, good, line3, good]) + b"\n")
    with pytest.raises(ValueError, match=f"rows.jsonl.*{message}"):
        load_conversations(str(path))


def test_a_row_too_long_to_regenerate_is_logged_with_its_input_row(tiny_target, tmp_path,
                                                                   caplog):
    from dflash_lab.data.regenerate_loop import RegenerateSettings, part_path, regenerate_part

    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    long = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "x"}]
    rows = [{"messages": short, "input_row": 7}, {"messages": long, "input_row": 8}]
    s = RegenerateSettings(out_dir=str(tmp_path), max_new_tokens=4, max_length=48)
    with caplog.at_level("WARNING"):
        regenerate_part(tiny_target, rows, 0, s)
    assert "input row 8 dropped: no assistant turn fitted" in caplog.text
    assert "input row 7" not in caplog.text
    assert part_path(tmp_path, 0).read_text().count("\n") == 1


def test_num_prompts_beyond_the_file_is_warned(tmp_path, caplog):
    import json

    from omegaconf import OmegaConf

    from dflash_lab.eval.suite import load_items

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]})
                            + "\n" for i in range(3)))
    with caplog.at_level("WARNING"):
        assert len(load_items(OmegaConf.create({"path": str(path)}), 50)) == 3
    assert "num_prompts=50 but" in caplog.text and "holds 3 rows" in caplog.text


# ------------------------------------------------- item 12: export temp dirs and modes
def test_an_export_killed_mid_way_leaves_a_temp_dir_the_next_run_removes(trained_run,
                                                                         tmp_path):
    """kill -9 while the export's temporary directory exists (its commit made to wait): the
    next export removes it (its pid is gone) and keeps a live process's one and foreign
    files; exported files are 0644 and the directory 0755 (umask 022), not mkdtemp's 0700."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from dflash_lab.export import export_drafter
    from dflash_lab.paths import REPO_ROOT

    src, out = trained_run, tmp_path / "out"
    code = ("import time, dflash_lab.export.api as a; a._commit = lambda *x: time.sleep(600); "
            f"a.export_drafter({str(src)!r}, {str(out)!r}, engine='vllm')")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    try:
        for _ in range(600):
            left = list(tmp_path.glob(".out.tmp-*"))
            if left and (left[0] / "EXPORT_REPORT.md").is_file():
                break
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(left) == 1, "the export never reached its commit"
    assert not out.exists()  # nothing half-made where the export goes
    live = tmp_path / f".out.tmp-{socket.gethostname()}-{os.getpid()}-live"
    live.mkdir()
    foreign = tmp_path / f".out.tmp-{socket.gethostname()}-{proc.pid}-notes"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    old_umask = os.umask(0o022)
    try:
        export_drafter(src, out, engine="vllm")
    finally:
        os.umask(old_umask)
    assert not left[0].exists()
    assert live.exists() and (foreign / "notes.txt").is_file()
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o644"}


def test_export_refuses_a_target_with_other_weights(trained_run, tiny_target_dir,
                                                    weights_capture, tmp_path, capsys):
    """dflash-export --target: the checkpoint's recorded weights fingerprint must match (issue
    16 item 3, exports); the same config with other weights is refused unless allowed."""
    from dflash_lab.export.cli import main

    other_dir = Path(weights_capture[1].name_or_path)
    assert main([str(trained_run), str(tmp_path / "a"), "--target", str(other_dir)]) == 2
    assert "weights fingerprint" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert main([str(trained_run), str(tmp_path / "b"), "--target", str(tiny_target_dir)]) == 0
    assert main([str(trained_run), str(tmp_path / "c"), "--target", str(other_dir),
                 "--allow-other-target-weights"]) == 0


def test_features_eval_refuses_another_checkpoints_capture(tiny_target, weights_capture,
                                                           tmp_path, caplog):
    """dflash-eval mode=features checks the capture's target weights like training does; its
    own config carries the override the message names; num_prompts past the capture warns."""
    from hydra import compose, initialize_config_dir

    from dflash_lab.eval import cli
    from tests.eval_doubles import tiny_drafter_for, write_serving_dir

    cap, other = weights_capture
    drafter = tiny_drafter_for(tiny_target, block_size=4, target_layer_ids=[1, 3])
    serving = write_serving_dir(drafter, tmp_path / "d")
    base = [f"drafter.path={serving}", f"data.path={cap}", "mode=features", "progress=false",
            "target=hf", f"target.name_or_path={other.name_or_path}", "target.device=cpu"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        refused = compose("eval", overrides=[*base, f"output_dir={tmp_path / 'a'}"])
        allowed = compose("eval", overrides=[*base, f"output_dir={tmp_path / 'b'}",
                                             "data.allow_other_target_weights=true",
                                             "num_prompts=10"])
    with pytest.raises(ValueError, match="data.allow_other_target_weights=true"):
        cli.evaluate(refused)
    with caplog.at_level("WARNING"):
        assert cli.evaluate(allowed)["num_samples"] == 4
    assert "num_prompts=10 but the capture" in caplog.text
