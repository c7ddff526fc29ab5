"""Who am I? Rank, world size and rendezvous from torchrun, Slurm srun or mpirun.

Every rank runs the same program; this module reads the launcher's environment once and returns
a `LaunchInfo`. Precedence: torchrun (it sets RANK/WORLD_SIZE even inside a Slurm job), then
Slurm (an `srun` step: SLURM_PROCID/SLURM_NTASKS), then MPI (Open MPI, MPICH/Intel PMI, PMIx),
then a single process.
"""
from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import sys
from dataclasses import dataclass
from typing import Mapping, Optional

from verl_mcore.distributed import cpu_compat
from verl_mcore.utils.device import set_compute_device

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "mpi" | "single"


class LaunchError(RuntimeError):
    pass


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist expression, in order.

    `gpu[001-003,007],login1` -> gpu001 gpu002 gpu003 gpu007 login1 (zero padding kept);
    `r[1-2]-n[01-02]` -> r1-n01 r1-n02 r2-n01 r2-n02 (several bracket groups: their product).
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_host(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"SLURM nodelist {text!r}: unbalanced ']' at position {i}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise LaunchError(f"SLURM nodelist {text!r}: unbalanced '['")
    items.append(text[start:])
    return [s for s in (x.strip() for x in items) if s]


def _expand_host(item: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", item)
    if not m:
        return [item]
    prefix, suffix = item[: m.start()], item[m.end():]
    out = []
    for part in m.group(1).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not sep:
            values = [lo]
        else:
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise LaunchError(f"SLURM nodelist entry {item!r}: bad range {part!r}")
            width = len(lo)
            values = [str(v).zfill(width) for v in range(int(lo), int(hi) + 1)]
        for v in values:
            out.extend(_expand_host(prefix + v + suffix))
    return out


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        if env.get(name, "") != "":
            try:
                return int(env[name].split("(")[0])  # SLURM_TASKS_PER_NODE may read "4(x2)"
            except ValueError:
                raise LaunchError(f"environment variable {name}={env[name]!r} is not an integer") from None
    return None


def detect_launch(env: Optional[Mapping[str, str]] = None, mpi_comm=None) -> LaunchInfo:
    """Read the launcher's environment (os.environ by default)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env)
    # Only inside an srun step: the batch script itself also has SLURM_PROCID=0, and treating it
    # as rank 0 of SLURM_NTASKS would wait forever for ranks that were never started.
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and in_step:
        return _from_slurm(env)
    for rank_var, size_var in [("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", "PMIX_SIZE")]:
        if rank_var in env:
            return _from_mpi(env, rank_var, size_var, mpi_comm)
    # One process rendezvous with itself: any free port does, so two runs on one machine
    # (or a run beside a test) never collide on a fixed port.
    return LaunchInfo(0, 1, 0, 1, env.get("MASTER_ADDR", "127.0.0.1"),
                      _int(env, "MASTER_PORT") or _free_port(), "single")


def _from_torchrun(env: Mapping[str, str]) -> LaunchInfo:
    world = _int(env, "WORLD_SIZE")
    return LaunchInfo(
        rank=_int(env, "RANK"),
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK") or 0,
        local_world_size=_int(env, "LOCAL_WORLD_SIZE") or world,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT") or DEFAULT_PORT,
        launcher="torchrun",
    )


def _from_slurm(env: Mapping[str, str]) -> LaunchInfo:
    if env.get("MASTER_ADDR"):
        master = env["MASTER_ADDR"]
    else:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise LaunchError("Slurm launch: SLURM_JOB_NODELIST is not set and MASTER_ADDR is not "
                              "given; cannot find the rendezvous host")
        master = expand_nodelist(nodelist)[0]
    port = _int(env, "MASTER_PORT")
    if port is None:
        # Jobs sharing a node must not share a port: derive it from the job id.
        port = 20000 + (_int(env, "SLURM_JOB_ID") or 0) % 20000
    world = _int(env, "SLURM_NTASKS")
    return LaunchInfo(
        rank=_int(env, "SLURM_PROCID"),
        world_size=world,
        local_rank=_int(env, "SLURM_LOCALID") or 0,
        local_world_size=_int(env, "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE") or world,
        master_addr=master,
        master_port=port,
        launcher="slurm",
    )


def _from_mpi(env: Mapping[str, str], rank_var: str, size_var: str, mpi_comm) -> LaunchInfo:
    rank, world = _int(env, rank_var), _int(env, size_var)
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK") or 0
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE") or world
    master, port = env.get("MASTER_ADDR"), _int(env, "MASTER_PORT")
    if master is None or port is None:
        # No agreed rendezvous in the environment: rank 0 announces its host and a free port.
        comm = mpi_comm
        if comm is None:
            try:
                from mpi4py import MPI
            except ImportError:
                raise LaunchError("launched by mpirun without MASTER_ADDR/MASTER_PORT: install "
                                  "mpi4py (pip install verl_mcore[mpi]) or export both") from None
            comm = MPI.COMM_WORLD
        mine = (socket.gethostname(), _free_port()) if comm.Get_rank() == 0 else None
        announced = comm.bcast(mine, root=0)
        master = master or announced[0]
        port = port or announced[1]
    return LaunchInfo(rank, world, local_rank, local_size, master, port, "mpi")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_distributed(info: LaunchInfo, device: str = "auto", timeout_s: float = 1800.0) -> str:
    """Make this process compute on `device` ("auto": CUDA when torch sees it) and initialise
    torch.distributed for `info`: NCCL with CUDA, gloo on the CPU. Returns the device type.

    The configured device decides, not CUDA's presence: "cpu" under a CUDA build installs
    cpu_compat as a CPU build does (utils/device.py says what breaks otherwise). Where a caller
    initialised torch.distributed already (a test, a user's script around Trainer), its process
    group is kept, and refused when its backend cannot move this device's tensors: megatron's
    groups inherit that backend, and gloo handed CUDA tensors in megatron's coalesced
    collectives segfaults instead of raising.
    """
    import torch
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    kind, backend = ("cuda", "nccl") if use_cuda else ("cpu", "gloo")
    if dist.is_initialized():
        found = dist.get_backend()
        # A backend per device type reads "cpu:gloo,cuda:nccl".
        if found != backend and f"{kind}:{backend}" not in found.split(","):
            raise LaunchError(
                f"trainer.device={device} computes on {kind}, which needs "
                f"the {backend} backend, but torch.distributed was initialised with {found!r} "
                f"before the trainer started (rank {info.rank}, torch {torch.__version__}): "
                f"initialise it with {backend!r}, or leave it to the trainer")
    if use_cuda:
        if not torch.cuda.is_available():
            raise LaunchError("trainer.device=cuda but torch sees no CUDA device on rank "
                              f"{info.rank} ({socket.gethostname()})")
        if not dist.is_initialized():  # a caller that initialised it chose its device
            torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        set_compute_device("cuda")
    else:
        # "cpu", not "auto": under a CUDA build too, or megatron builds on the GPU under gloo.
        cpu_compat.install("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if info.world_size == 1:
            # Nobody to meet: an in-memory store, no port to bind or to race for.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=f"tcp://{info.master_addr}:{info.master_port}",
                                    rank=info.rank, world_size=info.world_size, timeout=timeout)
    return kind


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(rank: int, level: int = logging.INFO) -> None:
    """Every log line carries its rank; INFO and below are printed by rank 0 only."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RankFilter(rank))
    handler.setFormatter(logging.Formatter("%(asctime)s [rank %(rank)d] %(levelname)s %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    root = logging.getLogger("verl_mcore")
    root.handlers[:] = [handler]
    root.setLevel(level if rank == 0 else max(level, logging.WARNING))
    root.propagate = False
