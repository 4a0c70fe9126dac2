"""Who an externally started rank is: read from torchrun's or SLURM's (submitit's) environment.

torchrun (torch/distributed/run.py) exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK`` (the node's rank), ``MASTER_ADDR``, ``MASTER_PORT`` and ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``).
A SLURM task started by Hydra's submitit launcher knows its place through ``submitit.JobEnvironment``
(``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_NTASKS``, ``SLURM_JOB_NODELIST`` on SLURM;
``SUBMITIT_LOCAL_*`` under ``hydra/launcher=submitit_local``); the rendezvous is then the job's first host and
a port derived from the job id (``MASTER_ADDR`` / ``MASTER_PORT`` in the environment win).
:meth:`RankEnv.export` writes the variables that ``torch.distributed``'s ``env://`` init and Lightning's
``TorchElasticEnvironment`` read.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Mapping

from zeroexp.config.schemas import ConfigError

__all__ = ["RankEnv", "detect"]

_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankEnv:
    """One rank's place in an external job (every field the same kind of value on every launcher)."""

    launcher: str  # torchrun | slurm
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # ranks on this node
    node_rank: int
    nodes: int
    master_addr: str
    master_port: int
    job_id: str | None  # torchrun: the rendezvous id; SLURM: the job id

    def export(self) -> None:
        """Set ``RANK`` ... ``MASTER_PORT``, ``GROUP_RANK`` and ``NODE_RANK`` in this process's environment."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
                          LOCAL_WORLD_SIZE=str(self.local_world_size), GROUP_RANK=str(self.node_rank),
                          NODE_RANK=str(self.node_rank), MASTER_ADDR=self.master_addr,
                          MASTER_PORT=str(self.master_port))


def detect(launcher: str, environ: Mapping[str, str] | None = None) -> RankEnv:
    """This process's :class:`RankEnv` under ``launcher`` (``torchrun`` or ``slurm``); ``ConfigError`` naming
    ``launcher`` when the process was not started that way."""
    environ = os.environ if environ is None else environ
    return _torchrun(environ) if launcher == "torchrun" else _slurm(environ)


def _torchrun(environ: Mapping[str, str]) -> RankEnv:
    missing = [k for k in _TORCHRUN if k not in environ]
    if missing:
        raise ConfigError("launcher", "torchrun", "local, or launcher=torchrun inside a torchrun job",
                          why=f"{', '.join(missing)} not set: this process was not started by torchrun "
                              "(see launchers/torchrun.sh)")
    world, local = int(environ["WORLD_SIZE"]), int(environ["LOCAL_WORLD_SIZE"])
    if world % local:
        raise ConfigError("launcher", "torchrun", "the same --nproc-per-node on every node",
                          why=f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")
    return RankEnv("torchrun", int(environ["RANK"]), world, int(environ["LOCAL_RANK"]), local,
                   int(environ.get("GROUP_RANK", environ.get("NODE_RANK", "0"))), world // local,
                   environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), environ.get("TORCHELASTIC_RUN_ID"))


def _slurm(environ: Mapping[str, str]) -> RankEnv:
    try:
        import submitit
        from submitit.slurm.slurm import SlurmJobEnvironment
    except ImportError as e:
        raise ConfigError("launcher", "slurm", "local, torchrun", why="hydra-submitit-launcher is not installed; "
                          "install it with: pip install -e '.[cluster]'") from e
    if environ.get("SUBMITIT_EXECUTOR"):
        job = submitit.JobEnvironment()
    elif "SLURM_PROCID" in environ:  # srun without submitit: SLURM's own variables
        job = SlurmJobEnvironment()
    else:
        raise ConfigError("launcher", "slurm", "local, torchrun, or launcher=slurm with --multirun",
                          why="this process is no SLURM task: Hydra's submitit launcher (--multirun) submits them")
    world, nodes = job.num_tasks, job.num_nodes
    if world % nodes:
        raise ConfigError("launcher", "slurm", "the same number of tasks on every node",
                          why=f"{world} tasks on {nodes} nodes")
    job_id = str(job.job_id)
    # One node: loopback, like the local launcher; several: the job's first host.
    addr = environ.get("MASTER_ADDR") or ("127.0.0.1" if nodes == 1 else job.hostnames[0])
    port = int(environ.get("MASTER_PORT") or 20000 + int(hashlib.sha1(job_id.encode()).hexdigest(), 16) % 40000)
    return RankEnv("slurm", job.global_rank, world, job.local_rank, world // nodes, job.node, nodes, addr, port,
                   job_id)
