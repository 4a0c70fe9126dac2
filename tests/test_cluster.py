"""launcher=torchrun and launcher=slurm (zeroexp/launch/cluster/): one machine playing two nodes, and Hydra's submitit
launcher running SLURM-style tasks locally; each must measure what the local launcher measures."""

from __future__ import annotations

import json
import logging
import re
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import BASE, read_csv, run_cli
from zeroexp.launch.cluster.env import detect
from zeroexp.config.schemas import ConfigError
from zeroexp.launch.local import free_port

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "GROUP_RANK", "SLURM_", "SUBMITIT_",
                                "TORCHELASTIC"))}
    return {**env, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **extra}


def _same_measurements(a: Path, b: Path) -> None:
    """State factors and per-rank bytes, collective counts and payload, loss: equal in both cell directories."""
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa["cell_id"] == sb["cell_id"]  # the launcher is not part of the cell
    assert sa["state"]["factors"] == sb["state"]["factors"] and sa["state"]["check"] == "PASS"
    for key in ("counts", "payload_bytes"):
        assert sa["collectives"][key] == sb["collectives"][key]
    assert sa["collectives"]["check"] == sb["collectives"]["check"] == "PASS"
    pd.testing.assert_frame_equal(pd.read_csv(a / "rank_state.csv"), pd.read_csv(b / "rank_state.csv"))
    pd.testing.assert_frame_equal(pd.read_csv(a / "collectives.csv"), pd.read_csv(b / "collectives.csv"))
    assert sa["iterations"]["global_loss"] == pytest.approx(sb["iterations"]["global_loss"], rel=1e-6)


def test_two_torchrun_nodes_measure_what_the_local_launcher_measures(cell, tmp_path):
    """Two torchrun agents on loopback (--nnodes=2, c10d rendezvous), one rank each: one cell of world size 2 (ranks
    and nodes counted apart: node_rank and local_rank differ from rank as they do at any size)."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [*TORCHRUN, "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=twonodes", f"--rdzv-conf=is_host={int(node == 0)}",
               "--local-addr=127.0.0.1", "-m", "zeroexp", "launcher=torchrun", "strategy=fsdp_full", "world_size=2",
               *BASE]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    (cell_dir,) = (tmp_path / "outputs" / "runs").iterdir()
    assert cell_dir.name.startswith("torchrun-twonodes_fsdp_full-pre_mlp_fp32_n2_")
    assert any(out.strip().endswith(str(cell_dir)) for out in outputs)  # rank 0's node prints the directory last
    rank0_out = next(out for out in outputs if out.strip().endswith(str(cell_dir)))
    for probe in ("state", "collectives", "memory", "timing", "equivalence", "plan"):  # the digest, one line each
        assert re.search(rf"^{probe}\s", rank0_out, re.M), (probe, rank0_out[-2000:])
    manifest = json.loads((cell_dir / "manifest.json").read_text())
    assert (manifest["status"], manifest["launcher"], manifest["nodes"], manifest["ranks_per_node"]) == \
           ("ok", "torchrun", 2, 1)
    assert manifest["job_id"] == "twonodes" and manifest["world_size"] == 2
    assert sorted((r["node_rank"], r["local_rank"]) for r in manifest["ranks"]) == [(0, 0), (1, 0)]
    assert [r["rank"] for r in manifest["ranks"]] == [0, 1] and all(r["exitcode"] == 0 for r in manifest["ranks"])
    assert sorted(p.name for p in (cell_dir / "logs").iterdir()) == [f"rank{r}.log" for r in range(2)]

    local = cell("strategy=fsdp_full", "world_size=2")
    assert local.status == "ok"
    assert json.loads((local.cell_dir / "manifest.json").read_text())["launcher"] == "local"
    _same_measurements(cell_dir, local.cell_dir)
    assert read_csv(local, "collectives.csv").groupby("rank")["count"].sum().tolist() == [24] * 2  # 16 AG + 8 RS


def test_a_failing_torchrun_rank_is_recorded(tmp_path):
    """Rank 1 raises at step 5: torchrun exits 1, the manifest says failed with rank 1's exception."""
    cmd = [*TORCHRUN, "--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=fault", "--local-addr=127.0.0.1", "-m", "zeroexp",
           "launcher=torchrun", *BASE]
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(ZEROEXP_FAULT="1:5:raise"), capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    (cell_dir,) = (tmp_path / "outputs" / "runs").iterdir()
    manifest = json.loads((cell_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["ended_at"]
    assert manifest["error"] == {"rank": 1, "cause": "exception", "log": "logs/rank1.log",
                                 "message": "rank 1: RuntimeError: injected fault: rank 1 raised at step 5 "
                                            "(log: logs/rank1.log)"}
    assert (cell_dir / ".ranks" / "rank1.error.json").exists() and not (cell_dir / "summary.json").exists()


def test_torchrun_launcher_refuses_what_it_cannot_run(tmp_path):
    """Outside torchrun, and with a world_size other than torchrun's: exit 2 before any rendezvous (``python -m
    zeroexp`` in this process, conftest.run_cli, with the environment each case needs)."""
    base = ["launcher=torchrun", *BASE]
    out = run_cli(*base, cwd=tmp_path, env=_env())
    text = " ".join(out.stdout.split())  # rich wraps the message at the terminal's width
    assert out.returncode == 2 and "RANK, WORLD_SIZE" in text and "not started by torchrun" in text, text
    assert not (tmp_path / "outputs" / "runs").exists() or not any((tmp_path / "outputs" / "runs").iterdir())
    one = _env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    out = run_cli(*base, "world_size=2", cwd=tmp_path, env=one)
    text = " ".join(out.stdout.split())
    assert out.returncode == 2 and "world_size=2" in text and "1, the number of ranks torchrun started" in text, text
    # the refused cell's directory is gone and no logging handler still writes into it (the next record any library
    # logs in this process would raise FileNotFoundError)
    handlers = [h for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
                for h in getattr(lg, "handlers", []) if isinstance(h, logging.FileHandler)]
    assert not [h.baseFilename for h in handlers if Path(h.baseFilename).is_relative_to(tmp_path)]
    logging.getLogger("transformers").warning("a record after the refusal")


def test_rank_environment_of_each_launcher():
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job7"}
    env = detect("torchrun", torchrun)
    assert ((env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank, env.nodes)
            == (3, 4, 1, 2, 1, 2))
    assert (env.master_addr, env.master_port, env.job_id) == ("10.1.2.3", 29500, "job7")
    with pytest.raises(ConfigError, match="not a multiple"):
        detect("torchrun", {**torchrun, "LOCAL_WORLD_SIZE": "3"})
    with pytest.raises(ConfigError, match="MASTER_PORT not set"):
        detect("torchrun", {k: v for k, v in torchrun.items() if k != "MASTER_PORT"})
    with pytest.raises(ConfigError, match="(no SLURM task|not installed)"):
        detect("slurm", {})


def test_submitit_local_sweep_runs_each_task_as_a_rank(cell, tmp_path):
    """launcher=slurm with hydra/launcher=submitit_local: jobs 0 and 1 are one cell: the second is skipped, the first
    runs as 2 submitit tasks = 2 ranks. Job 2 (offload=optimizer, which ddp does not implement) is refused by the job
    itself, before its rendezvous: its rank 0 records the cell ``refused`` with the key; the sweep exits 2."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cmd = [sys.executable, "-m", "zeroexp", "--multirun", "launcher=slurm", "hydra/launcher=submitit_local",
           "world_size=2", "offload=none,none,optimizer", *BASE]
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    (sweep,) = (tmp_path / "outputs" / "multirun").iterdir()
    manifests = {d: json.loads((d / "manifest.json").read_text()) for d in sweep.iterdir()
                 if d.is_dir() and not d.name.startswith(".")}
    (cell_dir,) = [d for d, m in manifests.items() if m["status"] != "refused"]
    (refused,) = [m for m in manifests.values() if m["status"] == "refused"]
    manifest = manifests[cell_dir]
    assert ((manifest["status"], manifest["launcher"], manifest["nodes"], manifest["ranks_per_node"])
            == ("ok", "slurm", 1, 2))
    assert [r["rank"] for r in manifest["ranks"]] == [0, 1] and manifest["job_id"]
    assert ((refused["launcher"], refused["error"]["cause"], refused["error"]["key"], refused["error"]["value"])
            == ("slurm", "invalid_config", "offload", "optimizer")) and refused["job_id"]
    assert json.loads((sweep / ".duplicate_jobs.json").read_text()) == {"1": 0}
    assert (sweep / "report.md").exists()
    local = cell("world_size=2")
    assert local.status == "ok"
    _same_measurements(cell_dir, local.cell_dir)


def test_slurm_layout_must_add_up_to_world_size(compose):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from zeroexp.config.schemas import validate

    with pytest.raises(ConfigError, match=r"launcher.nodes \* launcher.ranks_per_node = 2 \* 2 != world_size = 8"):
        validate(compose("launcher=slurm", "world_size=8", "launcher.nodes=2", "launcher.ranks_per_node=2"))


@pytest.mark.parametrize("launcher", ["local", "torchrun", "slurm"])
def test_every_launcher_option_composes_and_validates(compose, launcher):
    if launcher == "slurm":
        pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from zeroexp.config.schemas import validate

    cfg = compose(f"launcher={launcher}")
    validate(cfg)
    assert cfg.launcher.name == launcher
