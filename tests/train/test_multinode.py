"""Past one machine: the launcher's view of a process (torchrun, srun), start-up errors when the
trainer config disagrees with it, rank-0-only run records, and two torchrun "nodes" on
localhost (gloo) that train, are killed mid-epoch and resume the same loss curve."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from dflash_lab.data.shards import read_manifest, write_json_atomic
from dflash_lab.launch import (
    Launch,
    check_shared_run_dir,
    check_trainer_launch,
    detect_launch,
    is_global_zero,
)
from dflash_lab.paths import REPO_ROOT
from dflash_lab.runinfo import RUN_INFO_FILE, write_run_info
from dflash_lab.serving.launch import free_port
from dflash_lab.train.callbacks import check_same_start_step
from dflash_lab.train.cli import RUN_NAME_ENV, check_launch, share_run_name
from tests.train.test_train import SUBPROCESS_PYTHONPATH, _compose, _losses, _tiny_overrides

_LAUNCH_VARS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                "GROUP_RANK", "NODE_RANK", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
                "SLURM_NNODES", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NAME")


def _torchrun_env(rank, world, local_world):
    """What torchrun sets for one worker (``--nnodes world/local_world --nproc_per_node
    local_world``)."""
    return {"TORCHELASTIC_RUN_ID": "none", "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank % local_world), "LOCAL_WORLD_SIZE": str(local_world),
            "GROUP_RANK": str(rank // local_world)}


def _slurm_env(procid, ntasks, nnodes, **extra):
    """What srun sets for one task."""
    return {"SLURM_NTASKS": str(ntasks), "SLURM_PROCID": str(procid), "SLURM_NNODES": str(nnodes),
            "SLURM_LOCALID": str(procid % (ntasks // nnodes)), "SLURM_JOB_NAME": "train",
            **extra}


@pytest.fixture
def launched(monkeypatch):
    """Set a launcher's variables in os.environ (all others cleared)."""
    for key in _LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)

    def set_env(env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
    return set_env


# ----------------------------------------------------------------------------- the launch
def test_torchrun_and_srun_give_the_global_rank_and_the_node_layout():
    assert detect_launch(_torchrun_env(3, 4, 2)) == Launch("torchrun", 3, 4, 1, 2, 2)
    assert detect_launch(_slurm_env(5, 8, 2)) == Launch("slurm", 5, 8, 1, 4, 2)
    # torchrun inside an srun allocation (srun torchrun ...): torchrun's ranks win
    assert detect_launch({**_slurm_env(1, 2, 2), **_torchrun_env(3, 4, 2)}).rank == 3
    assert detect_launch(_slurm_env(0, 2, 1, SLURM_JOB_NAME="interactive")) is None
    assert detect_launch({}) is None
    with pytest.raises(ValueError, match="SLURM_NTASKS=3 tasks on SLURM_NNODES=2"):
        detect_launch({**_slurm_env(0, 4, 2), "SLURM_NTASKS": "3"})


def test_global_zero_is_rank_zero_of_the_job_not_of_the_node():
    """Local rank 0 of the second node is not global zero under any launcher."""
    assert is_global_zero(_torchrun_env(0, 4, 2))
    assert not is_global_zero(_torchrun_env(2, 4, 2))  # LOCAL_RANK=0 on node 1
    assert not is_global_zero({**_slurm_env(2, 4, 2), "LOCAL_RANK": "0"})
    assert not is_global_zero({"NODE_RANK": "1", "LOCAL_RANK": "0"})  # Lightning, by hand
    assert not is_global_zero({"LOCAL_RANK": "1"})  # a child of Lightning's launcher
    assert is_global_zero({})


# ----------------------------------------------------------------------------- start-up errors
_DDP = {"accelerator": "cpu", "devices": 1, "num_nodes": 2, "strategy": "ddp",
        "use_distributed_sampler": False}


@pytest.mark.parametrize(("trainer", "launch", "message"), [
    ({"num_nodes": 1}, _torchrun_env(0, 2, 1), r"trainer.num_nodes=1 .*set trainer.num_nodes=2"),
    ({"devices": 2, "num_nodes": 1}, _torchrun_env(0, 2, 1), "trainer.num_nodes=1"),
    ({"devices": 2}, _torchrun_env(0, 4, 2), None),
    ({"devices": 1}, _torchrun_env(0, 4, 2), r"trainer.devices=1 .*set trainer.devices=2"),
    ({"devices": "auto"}, _torchrun_env(0, 4, 2), r"trainer.devices='auto'"),
    ({"num_nodes": 3}, _slurm_env(0, 4, 2), r"slurm started 4 processes on 2 node\(s\)"),
    ({"devices": [0, 1]}, _slurm_env(0, 4, 2, SLURM_NTASKS_PER_NODE="2"), None),
    ({"use_distributed_sampler": True}, _torchrun_env(0, 2, 1), "use_distributed_sampler=false"),
    ({}, {}, "no launcher started this process"),
])
def test_a_trainer_config_that_disagrees_with_the_launcher_fails_at_start_up(trainer, launch,
                                                                             message):
    config = {**_DDP, **trainer}
    if message is None:
        check_trainer_launch(config, detect_launch(launch))
        return
    with pytest.raises(ValueError, match=message):
        check_trainer_launch(config, detect_launch(launch), "conf/trainer/ddp_cpu.yaml")


def test_cli_checks_the_composed_trainer_against_torchrun(launched, tmp_path):
    """``trainer=ddp_cpu`` (2 processes per node) under 2 torchrun nodes of one process each."""
    launched(_torchrun_env(1, 2, 1))
    cfg = _compose(["trainer=ddp_cpu", "trainer.num_nodes=2", f"paths.output_dir={tmp_path}"])
    with pytest.raises(ValueError, match="trainer.devices=2 .*set trainer.devices=1"):
        check_launch(cfg)
    check_launch(_compose(["trainer=cpu", "trainer.num_nodes=2", f"paths.output_dir={tmp_path}"]))


def test_launched_processes_must_share_one_run_directory(launched, tmp_path):
    """The default run name is each process's own start time: refused under torchrun."""
    launched(_torchrun_env(0, 2, 1))
    with pytest.raises(ValueError, match="run_name=NAME"):
        check_launch(_compose(["trainer.num_nodes=2"]))
    check_launch(_compose(["trainer.num_nodes=2", "run_name=job42"]))
    check_launch(_compose(["trainer.num_nodes=2", f"paths.output_dir={tmp_path}"]))
    check_shared_run_dir("${now:%H}", "${run_name}", None)  # one process: nothing to share


def test_lightning_launcher_children_take_the_first_process_run_name():
    parent = OmegaConf.create({"run_name": "20260101-000000"})
    env = {}
    share_run_name(parent, env)
    child = OmegaConf.create({"run_name": "20260101-000001"})  # started a second later
    share_run_name(child, {**env, "LOCAL_RANK": "1"})
    assert child.run_name == "20260101-000000"
    assert env[RUN_NAME_ENV] == "20260101-000000"


def test_run_info_is_written_by_global_rank_zero_only(launched, tmp_path):
    launched(_torchrun_env(1, 2, 1))  # LOCAL_RANK=0 on the second node
    write_run_info(tmp_path / "a", {"x": 1})
    assert not (tmp_path / "a").exists()
    launched(_torchrun_env(0, 2, 1))
    info = json.loads(write_run_info(tmp_path / "a", {"x": 1}).read_text())
    assert info["launch"] == {"launcher": "torchrun", "world_size": 2, "num_nodes": 2,
                              "processes_per_node": 1}
    assert (tmp_path / "a/config.yaml").read_text() == "x: 1\n"


def test_ranks_that_would_start_from_different_steps_stop_together():
    """One node found last.ckpt (step 7), the other did not (step 0)."""
    def trainer(steps):
        gather = SimpleNamespace(all_gather=lambda t: torch.tensor(steps))
        return SimpleNamespace(strategy=gather, global_step=steps[0])

    with pytest.raises(RuntimeError, match=r"step per rank: \[7, 0\].*shared filesystem"):
        check_same_start_step(trainer([7, 0]), torch.device("cpu"))
    check_same_start_step(trainer([7, 7]), torch.device("cpu"))


def _write_record_repeatedly(path: str, times: int, errors) -> None:
    try:
        for i in range(times):
            write_json_atomic(Path(path), {"i": i, "pad": "x" * 4096})
    except OSError as err:
        errors.put(repr(err))


def test_ranks_writing_one_record_at_once_do_not_collide(tmp_path):
    """Every rank writes the capture plan, the demo data and regeneration's settings.json at
    start, and two ranks that finish together both merge the manifest. With one shared
    temporary name a rank renamed the other's file, then failed its own rename."""
    ctx = multiprocessing.get_context("fork")  # nothing but file writes in the children
    errors = ctx.Queue()
    path = str(tmp_path / "manifest.json")
    procs = [ctx.Process(target=_write_record_repeatedly, args=(path, 300, errors))
             for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert errors.empty(), errors.get()
    assert json.loads(Path(path).read_text())["i"] == 299
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


# ----------------------------------------------------------------------------- two nodes
def _torchrun_two_nodes(overrides, log_dir: Path, module: str = "dflash_lab.train.cli",
                        timeout: float = 600) -> list[int]:
    """An entry point as two torchrun "nodes" of one process each on localhost (static
    rendezvous; training forms a gloo group): the two agents run at once, as on two machines
    sharing a filesystem. Returns both agents' exit codes; their output goes to
    ``log_dir/node{0,1}.log``."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=SUBPROCESS_PYTHONPATH, OMP_NUM_THREADS="1")
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc_per_node", "1", "--node_rank", str(node), "--master_addr", "127.0.0.1",
               "--master_port", str(port), "--max_restarts", "0",
               "-m", module, *overrides]
        with open(log_dir / f"node{node}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.mark.slow
def test_two_torchrun_nodes_train_die_mid_epoch_and_resume_the_same_loss_curve(tiny_target_dir,
                                                                               tmp_path):
    """``recipe=tiny_cpu trainer.num_nodes=2`` on two one-process torchrun nodes: 36 training
    rows, 18 a rank, 5 steps of 4 an epoch (one process alone would take 9). Both ranks are
    SIGKILLed before step 10, after the mid-epoch last.ckpt of step 7; the resumed run recomputes
    steps 8 and 9 (logged as 7 and 8: restored weights, then one step of the restored
    optimizer), which must equal those the killed run computed before it died (that run was
    uninterrupted up to there), and then finishes the 2 epochs."""
    overrides = _tiny_overrides(tmp_path, tiny_target_dir, **{
        "trainer.num_nodes": 2, "trainer.max_epochs": 2, "trainer.log_every_n_steps": 1,
        "data.batch_size": 4, "validate_before_fit": False,
        "callbacks.checkpoint.last_every_n_steps": 7,
        "+logger.flush_logs_every_n_steps": 1})  # the killed run keeps every step's loss
    kill = ["+callbacks.kill._target_=tests.doubles.kill_at_step_callback",
            "+callbacks.kill.step=9"]
    run_dir = tmp_path / "run"
    codes = _torchrun_two_nodes(overrides + kill, tmp_path / "killed")
    assert all(code != 0 for code in codes), "both nodes were supposed to be killed"
    last = torch.load(run_dir / "checkpoints/last.ckpt", weights_only=False)
    assert last["global_step"] == 7
    killed = _losses(run_dir)
    assert sorted(killed) == list(range(9))
    codes = _torchrun_two_nodes(overrides, tmp_path / "resumed")  # ckpt_path=auto
    logs = [(tmp_path / f"resumed/node{n}.log").read_text() for n in range(2)]
    assert codes == [0, 0], logs
    resumed = _losses(run_dir)
    assert sorted(resumed) == list(range(10))  # 2 epochs x 5 steps: both ranks took part
    for step in (7, 8):
        assert resumed[step] == pytest.approx(killed[step], rel=1e-5, abs=1e-6), step
    assert "val tau:" in logs[0] and "val tau:" not in logs[1]  # the summary: global rank 0
    info = json.loads((run_dir / RUN_INFO_FILE).read_text())
    assert info["launch"] == {"launcher": "torchrun", "world_size": 2, "num_nodes": 2,
                              "processes_per_node": 1}


@pytest.mark.slow
def test_two_torchrun_nodes_capture_their_own_shards_and_the_last_merges(tiny_target_dir,
                                                                          tmp_path):
    """dflash-capture on two torchrun nodes at once: both write the demo data and the plan at
    start, node 0 (global rank 0) captures shards 0 and 2, node 1 shards 1 and 3, one of them
    merges the manifest of all four (the shard contents and the rank split are tested in
    tests/data/test_capture.py)."""
    out = tmp_path / "cap"
    overrides = [f"target.path={tiny_target_dir}", f"capture.out_dir={out}",
                 "data.demo_rows=16", f"data.demo_file={tmp_path / 'demo.jsonl'}",
                 "capture.shard_size=4", "capture.progress=false"]
    codes = _torchrun_two_nodes(overrides, tmp_path / "logs", module="dflash_lab.capture")
    logs = [(tmp_path / f"logs/node{n}.log").read_text() for n in range(2)]
    assert codes == [0, 0], logs
    for node in range(2):
        assert f"rank {node}/2" in logs[node]  # torchrun's global RANK / WORLD_SIZE
    manifest = read_manifest(out)
    assert manifest["num_samples"] == 16 and [r["index"] for r in manifest["shards"]] == [0, 1,
                                                                                        2, 3]
    info = json.loads((out / RUN_INFO_FILE).read_text())
    assert info["launch"]["world_size"] == 2 and info["launch"]["num_nodes"] == 2
