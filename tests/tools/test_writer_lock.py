"""One writer per output directory (dflash_lab/writer_lock.py): a second process is refused
naming the holder, an abandoned lock is taken over with a message, only rank 0 locks, and
every command that owns an output directory takes the lock before writing anything."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from dflash_lab.paths import REPO_ROOT
from dflash_lab.writer_lock import (
    LOCK_NAME,
    DirectoryBusy,
    lock_path_for,
    writer_lock,
)

HOLD = ("import sys, time; from dflash_lab.writer_lock import writer_lock\n"
        "with writer_lock(sys.argv[1], what='paths.output_dir', command='dflash-train first'):\n"
        "    print('held', flush=True); time.sleep(120)\n")


@pytest.fixture
def holder(tmp_path):
    """Another live process holding ``tmp_path / 'run'``'s lock."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "NODE_RANK")}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield run, proc
    proc.kill()
    proc.wait()


def _lock(path, **fields):
    record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": None,
              "started": "2026-12-01T00:00:00+00:00", "command": "dflash-train old",
              "directory": str(path.parent.absolute()), "lease_s": 600.0, "token": "t0"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**record, **fields}))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_writer_is_refused_naming_the_holder(holder):
    run, proc = holder
    with pytest.raises(DirectoryBusy) as err, writer_lock(run, what="paths.output_dir"):
        pytest.fail("the lock was taken twice")
    message = str(err.value)
    assert f"pid {proc.pid} on {socket.gethostname()}" in message
    assert "dflash-train first" in message and "paths.output_dir" in message
    assert str(run / LOCK_NAME) in message
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == proc.pid  # untouched


def test_a_lock_of_a_dead_process_is_taken_over_with_a_message(tmp_path, capsys):
    run = tmp_path / "run"
    _lock(run / LOCK_NAME, pid=_dead_pid())
    with writer_lock(run, what="paths.output_dir") as path:
        assert json.loads(path.read_text())["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert "taking over the lock of dflash-train old" in err and "is gone" in err
    assert not (run / LOCK_NAME).exists()  # released
    assert [p.name for p in run.iterdir()] == []  # the stale one was not kept aside


def test_a_recycled_pid_does_not_hold_the_lock(tmp_path, capsys):
    run = tmp_path / "run"
    _lock(run / LOCK_NAME, pid=os.getpid(), pid_start="1")  # our pid, another start time
    with writer_lock(run, what="paths.output_dir"):
        pass
    assert "is another process now" in capsys.readouterr().err


def test_another_hosts_lock_holds_until_its_lease_runs_out(tmp_path, capsys):
    run = tmp_path / "run"
    _lock(run / LOCK_NAME, host="node-7", pid=1, lease_s=60.0)
    with pytest.raises(DirectoryBusy, match="pid 1 on node-7"), writer_lock(
            run, what="paths.output_dir"):
        pass
    old = time.time() - 120
    os.utime(run / LOCK_NAME, (old, old))
    with writer_lock(run, what="paths.output_dir"):
        pass
    assert "has not been refreshed for 120 s (lease 60 s)" in capsys.readouterr().err


def test_a_lock_copied_with_its_directory_does_not_hold_the_copy(holder, tmp_path, capsys):
    run, _ = holder
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / LOCK_NAME).write_bytes((run / LOCK_NAME).read_bytes())
    with writer_lock(copy, what="paths.output_dir"):
        pass
    assert f"it was taken for {run.absolute()} (this directory is a copy)" in (
        capsys.readouterr().err)


def test_the_holder_refreshes_its_lock_and_releases_only_its_own(tmp_path):
    run = tmp_path / "run"
    with writer_lock(run, what="paths.output_dir", lease_s=0.5) as path:
        old = time.time() - 100
        os.utime(path, (old, old))
        time.sleep(0.4)  # a heartbeat every lease / 5
        assert time.time() - path.stat().st_mtime < 50
        record = json.loads(path.read_text())
        path.write_text(json.dumps({**record, "token": "another process"}))
    assert path.exists()  # not ours any more: left alone


def test_only_the_global_rank_zero_takes_the_lock(holder):
    run, _ = holder
    with writer_lock(run, what="paths.output_dir", env={"RANK": "1"}) as path:
        assert path is None


def test_an_export_dir_is_locked_beside_it(tmp_path):
    out = tmp_path / "export"
    assert lock_path_for(out, beside=True) == tmp_path / ".export.dflash-lock"
    with writer_lock(out, what="OUT_DIR", beside=True) as path:
        assert path == tmp_path / ".export.dflash-lock" and not out.exists()


@pytest.mark.parametrize(("entry", "cfg"), [
    ("dflash_lab.train.run:train", {"paths": {"output_dir": "D"}}),
    ("dflash_lab.capture:capture", {"capture": {"out_dir": "D"}}),
    ("dflash_lab.eval.cli:evaluate", {"output_dir": "D"}),
])
def test_every_command_takes_the_lock_before_anything_else(holder, entry, cfg):
    """A config holding nothing but the output directory: the lock is the first thing the
    command does (it would fail on the missing settings otherwise)."""
    import importlib

    run, _ = holder
    module, name = entry.split(":")
    fn = getattr(importlib.import_module(module), name)
    cfg = OmegaConf.create(json.loads(json.dumps(cfg).replace('"D"', json.dumps(str(run)))))
    with pytest.raises(DirectoryBusy, match="is being written by another process"):
        fn(cfg)
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]


def test_regenerate_takes_the_lock_before_anything_else(holder, tmp_path):
    from hydra import compose, initialize_config_dir

    from dflash_lab.paths import CONF_DIR
    from dflash_lab.regenerate import regenerate

    run, _ = holder
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("regenerate", overrides=[f"regenerate.settings.out_dir={run}"])
    with pytest.raises(DirectoryBusy, match="regenerate.settings.out_dir"):
        regenerate(cfg)
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]


def test_a_second_dflash_train_exits_2_naming_the_first(holder, tiny_target_dir):
    run, proc = holder
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "DFLASH_DEBUG")}
    done = subprocess.run([sys.executable, "-m", "dflash_lab.train.cli", "recipe=tiny_cpu",
                           "logger=none", f"target.path={tiny_target_dir}",
                           f"paths.output_dir={run}"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"error: paths.output_dir {run} is being written by another process" in done.stderr
    assert f"pid {proc.pid}" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # nothing written
