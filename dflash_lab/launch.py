"""Which launcher started this process (torchrun, srun, or none) and where the process stands in
the job, read from the environment before any process group exists, so entry points can check
settings at start-up and do rank-0-only work on the right process. Every process of a multi-node
job is assumed to see one shared filesystem (docs/training.md, "Past one machine").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_SLURM_INTERACTIVE = ("bash", "interactive")


@dataclass(frozen=True)
class Launch:
    """An external launcher's view of this process: global ``rank`` in ``world_size``
    processes, ``local_rank`` of ``local_world_size`` processes on this node, ``num_nodes``."""

    launcher: str  #: "torchrun" or "slurm"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    num_nodes: int


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError as err:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from err


def _slurm(env: Mapping[str, str]) -> Launch:
    world, nodes = _int(env, "SLURM_NTASKS"), _int(env, "SLURM_NNODES")
    if "SLURM_NTASKS_PER_NODE" in env and env["SLURM_NTASKS_PER_NODE"].isdigit():
        per_node = _int(env, "SLURM_NTASKS_PER_NODE")
    elif world % nodes == 0:
        per_node = world // nodes
    else:
        raise ValueError(f"SLURM placed SLURM_NTASKS={world} tasks on SLURM_NNODES={nodes} nodes "
                         "unevenly: request the same number on every node (#SBATCH "
                         "--ntasks-per-node=P, P = GPUs per node)")
    return Launch("slurm", _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID"),
                  per_node, nodes)


def detect_launch(env: Mapping[str, str] | None = None) -> Launch | None:
    """The torchrun or SLURM launch of this process, or None (one process, Lightning's launcher)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env:
        world, local_world = _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE")
        return Launch("torchrun", _int(env, "RANK"), world, _int(env, "LOCAL_RANK"), local_world,
                      max(world // local_world, 1))
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in _SLURM_INTERACTIVE:
        return _slurm(env)
    return None


def is_global_zero(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is global rank 0 of its job (not merely local rank 0 of a node)."""
    env = os.environ if env is None else env
    launch = detect_launch(env)
    if launch is not None:
        return launch.rank == 0
    if "RANK" in env:  # set by hand or by another launcher
        return int(env["RANK"]) == 0
    # Lightning's own launcher: children carry LOCAL_RANK >= 1, other nodes NODE_RANK >= 1.
    return int(env.get("NODE_RANK", 0) or 0) == 0 and int(env.get("LOCAL_RANK", 0) or 0) == 0


# ------------------------------------------------------------------------------ training checks
def trainer_devices(trainer: Mapping[str, Any]) -> int | None:
    """Processes per node a trainer config asks for (``devices``): an int, a list's length, or
    ``auto`` as Lightning resolves it (CPU: 1, GPU: visible GPUs); None when not known here."""
    devices = trainer.get("devices", "auto")
    if not isinstance(devices, (str, int)) and hasattr(devices, "__len__"):
        return len(devices)  # a list of device indices
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and devices > 0:
        return devices
    if devices in ("auto", -1):
        if str(trainer.get("accelerator", "auto")) == "cpu":
            return 1
        import torch

        return torch.cuda.device_count() or None
    return None


def check_trainer_launch(trainer: Mapping[str, Any], launch: Launch | None,
                         source: str = "the trainer config") -> None:
    """ValueError at start-up when ``trainer.num_nodes`` / ``trainer.devices`` disagree with the
    launcher (instead of a hang, or ranks that each train alone)."""
    nodes = int(trainer.get("num_nodes", 1) or 1)
    devices = trainer_devices(trainer)
    if launch is None:
        if nodes > 1 and "NODE_RANK" not in os.environ:
            raise ValueError(
                f"trainer.num_nodes={nodes} ({source}) but no launcher started this process: "
                f"start one process per GPU with torchrun --nnodes {nodes} ... or srun (README, "
                "'Past one machine'), or set trainer.num_nodes=1")
        return
    how = (f"{launch.launcher} started {launch.world_size} processes on {launch.num_nodes} "
           f"node(s), {launch.local_world_size} per node")
    if nodes != launch.num_nodes:
        raise ValueError(f"trainer.num_nodes={nodes} ({source}) but {how}: set "
                         f"trainer.num_nodes={launch.num_nodes}")
    if devices is not None and devices != launch.local_world_size:
        raise ValueError(f"trainer.devices={trainer.get('devices')!r} ({source}, {devices} "
                         f"process(es) per node) but {how}: set "
                         f"trainer.devices={launch.local_world_size} or start "
                         f"{devices} process(es) per node")
    if launch.world_size > 1 and trainer.get("use_distributed_sampler", True):
        raise ValueError(f"trainer.use_distributed_sampler=true ({source}) under {how}: the "
                         "data module's sampler splits by rank itself; set "
                         "trainer.use_distributed_sampler=false")


def check_shared_run_dir(run_name: Any, output_dir: Any, launch: Launch | None) -> None:
    """Several launched processes must name one run directory. The default ``run_name`` is
    the start time, read by each process at its own start (seconds apart across nodes), so it
    is refused there; ``run_name`` / ``output_dir`` are the unresolved config values."""
    if launch is None or launch.world_size == 1:
        return
    if "${now:" in str(run_name) and "run_name" in str(output_dir):
        raise ValueError(
            f"{launch.launcher} started {launch.world_size} processes and each would name its "
            f"run directory after its own start time (run_name={run_name}): give them one, "
            "on the shared filesystem: run_name=NAME (e.g. run_name=$SLURM_JOB_ID) or "
            "paths.output_dir=DIR")
