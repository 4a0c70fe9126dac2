"""Reliability: bad input refused up front (exit 2, key named, nothing started), failed and hung ranks end
the cell within the timeouts with no process left, sweeps survive a failed cell and resume, writes are
atomic, secrets never reach a file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from conftest import run_cli
from zeroexp.results.files import read_json, write_json

pytestmark = pytest.mark.serial  # fresh interpreters waited on with timeouts: run alone (conftest, Makefile)

BAD = [  # (override, key the message must name)
    ("strategy=foo", "strategy"), ("model=nosuchmodel", "model"), ("prefetch=sideways", "prefetch"),
    ("precision=fp64", "precision"), ("offload=nvme", "offload"), ("logger=tensorboard", "logger"),
    ("experiment=nope", "experiment"), ("world_size=0", "world_size"), ("world_size=-4", "world_size"),
    ("world_size=two", "world_size"), ("steps=0", "steps"), ("batch_size=0", "batch_size"),
    ("batch_size=1.5", "batch_size"), ("seed=abc", "seed"), ("warmup_steps=-1", "warmup_steps"),
    ("model.width=abc", "model.width"), ("model.width=0", "model.width"), ("model.depth=-2", "model.depth"),
    ("model.widht=3", "model.widht"), ("model.loss=hinge", "model.loss"), ("model.dtype=int8", "model.dtype"),
    ("model._target_=torch.nn.NoSuchLayer", "model._target_"), ("model._target_=os.getcwd", "model._target_"),
    ("strategy.bucket_cap_mb=big", "strategy.bucket_cap_mb"), ("prefetch=post", "prefetch"),
    ("device=tpu", "device"), ("logger.mode=loud", "logger.mode"), ("timeout.collective_s=0", "timeout.collective_s"),
    ("optimizer.lr=fast", "optimizer.lr"), ("strategy=fsdp_full strategy.wrap=[torch.nn.Nope]", "strategy.wrap"),
    # keys that nothing reads, and values torch would refuse later, inside a rank
    ("+anything=1", "anything"), ("+stepz=10", "stepz"), ("+optimizer.foo=1", "optimizer.foo"),
    ("+timeout.x=1", "timeout.x"), ("+probes.x=1", "probes.x"), ("+model.foo=1", "model.foo"),
    ("strategy.bucket_cap_mb=-1", "strategy.bucket_cap_mb"),
    ("strategy=zro strategy.bucket_cap_mb=0", "strategy.bucket_cap_mb"),
    ("optimizer.lr=-1", "optimizer.lr"), ("optimizer.betas=[1.5,0.9]", "optimizer.betas"),
    ("optimizer.betas=[0.9]", "optimizer.betas"), ("optimizer.eps=0", "optimizer.eps"),
    ("optimizer.weight_decay=-1", "optimizer.weight_decay"), ("probes.profile_steps=0", "probes.profile_steps"),
    ("probes.memory_steps=-1", "probes.memory_steps"), ("timeout.grace_s=-1", "timeout.grace_s"),
    ("strategy=fsdp_full strategy.sharding=HALF", "strategy.sharding"),
    ("strategy=fsdp_full strategy.use_orig_params=maybe", "strategy.use_orig_params"),
    ("precision.growth_interval=0", "precision.growth_interval"), ("seed=-1", "seed"),
    ("launcher.nodes=0", "launcher.nodes"),
    # the model, built on the meta device with one forward and the loss at the cell's input shape
    ("model=custom model._target_=torch.nn.Linear +model.in_features=16 +model.out_features=16 "
     "model.input_shape=[8]", "model.input_shape"),
    ("model=gpt model.n_head=3", "model.n_head"), ("model=transformer_layer model.nhead=5", "model._target_"),
    ("model.loss=next_token", "model.loss"), ("model=gpt model.input_shape=[64]", "model.input_shape"),
]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB", "ZEROEXP"))}
    env.update(extra)
    return env


def _refuse_in_process(override: str, cell_dir: Path) -> tuple[int, float, str]:
    """Run the real CLI entry point (``zeroexp.cli.run.main``) in this process (conftest.run_cli): same code path as
    ``python -m zeroexp``, without paying the interpreter start-up for each of the many cases."""
    extra = [] if override.startswith("logger") else ["logger=none"]
    t0 = time.monotonic()
    proc = run_cli(*override.split(), *extra, f"hydra.run.dir={cell_dir}")
    return proc.returncode, time.monotonic() - t0, proc.stdout + proc.stderr


def test_bad_overrides_are_refused_before_any_rank(tmp_path, monkeypatch):
    import zeroexp.launch.local as launch

    def no_launch(*a, **k):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "launch_local", no_launch)
    monkeypatch.chdir(tmp_path)
    assert len(BAD) >= 25
    for i, (override, key) in enumerate(BAD):
        code, seconds, out = _refuse_in_process(override, tmp_path / f"cell{i}")
        assert code == 2, (override, out)
        assert key in out, (override, key, out)
        assert seconds < 10, (override, seconds)
        assert not (tmp_path / f"cell{i}").exists(), override  # nothing that looks like a result


def test_an_exception_in_the_check_of_a_sweeps_jobs_stops_it_before_its_first_cell(tmp_path, monkeypatch):
    """Hydra turns a callback's exception into a warning and runs the sweep on (``Callbacks._notify``): zeroexp's
    check of the jobs stops it instead, its message on stderr, exit 2, no cell run."""
    import zeroexp.launch.local as launch
    import zeroexp.cli.sweep as sweep

    def broken(*args, **kwargs):
        raise RuntimeError("ConfigLoader is not set")

    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    monkeypatch.setattr(sweep, "sweep_jobs", broken)
    proc = run_cli("--multirun", "strategy=ddp,zro", "logger=none", "world_size=2", f"hydra.sweep.dir={tmp_path}/sweep",
                   cwd=tmp_path, env=_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: zeroexp's check of the sweep's jobs raised RuntimeError: ConfigLoader is not set\nnothing was run" \
        in proc.stderr, proc.stderr
    assert not list((tmp_path / "sweep").glob("*/manifest.json"))  # no cell ran


@pytest.mark.parametrize("state", ["missing", "empty", "no sweep"])
def test_resume_into_a_sweep_dir_with_nothing_to_resume_is_refused_naming_hydra_sweep_dir(state, tmp_path,
                                                                                         monkeypatch):
    """``resume=true`` into a mistyped path (missing), an empty directory or one no sweep wrote: exit 2 naming
    ``hydra.sweep.dir`` and the path, before zeroexp's check of the jobs, no cell run and no directory made."""
    import zeroexp.launch.local as launch
    import zeroexp.cli.sweep as sweep

    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    monkeypatch.setattr(sweep, "sweep_jobs", lambda *a, **k: (_ for _ in ()).throw(AssertionError("checked")))
    target = tmp_path / "sweepp"
    if state != "missing":
        target.mkdir()
    if state == "no sweep":
        (target / "notes.txt").write_text("not a sweep")
    proc = run_cli("--multirun", "strategy=ddp,zro", "logger=none", "world_size=2", f"hydra.sweep.dir={target}",
                   "resume=true", cwd=tmp_path, env=_env())
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, out
    assert f"hydra.sweep.dir='{target}'" in out and "resume=true" in out, out
    assert "nothing there can be resumed" in out and "nothing was run" in out and "Traceback" not in out, out
    assert {"missing": "does not exist", "empty": "is empty", "no sweep": "holds no sweep"}[state] in out, out
    assert (not target.exists()) if state == "missing" else {p.name for p in target.iterdir()} <= {"notes.txt"}


def test_check_resume_accepts_a_directory_an_earlier_sweep_wrote(tmp_path):
    """A sweep directory with Hydra's ``multirun.yaml`` (written before the first job) or a cell's manifest (a stale
    sweep, tests/test_fault_matrix.py) resumes; ``resume=false`` is never refused; without ``hydra.sweep.dir`` the
    refusal says that the default is a new directory."""
    from omegaconf import OmegaConf

    from zeroexp.cli.sweep import check_resume
    from zeroexp.config.schemas import ConfigError

    def cfg(sweep_dir: Path, resume: bool = True, given: bool = True) -> object:
        hydra = {"sweep": {"dir": str(sweep_dir)}, "overrides": {"hydra": [f"hydra.sweep.dir={sweep_dir}"] * given}}
        return OmegaConf.create({"resume": resume, "hydra": hydra})

    check_resume(cfg(tmp_path / "missing", resume=False))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "multirun.yaml").write_text("{}")
    check_resume(cfg(tmp_path / "a"))
    (tmp_path / "b" / "ddp_cell").mkdir(parents=True)
    (tmp_path / "b" / "ddp_cell" / "manifest.json").write_text('{"status": "running"}')
    check_resume(cfg(tmp_path / "b"))
    (tmp_path / "c" / "ddp_cell").mkdir(parents=True)  # a cell directory with no manifest: nothing to resume
    with pytest.raises(ConfigError, match="hydra.sweep.dir=.*holds no sweep") as e:
        check_resume(cfg(tmp_path / "c"))
    assert e.value.key == "hydra.sweep.dir"
    with pytest.raises(ConfigError, match="does not exist.*hydra.sweep.dir was not given"):
        check_resume(cfg(tmp_path / "missing", given=False))


def test_resume_in_a_single_run_is_refused_naming_resume(tmp_path, monkeypatch):
    """A single run has no sweep to resume: ``resume=true`` there is refused (exit 2) rather than ignored."""
    import zeroexp.launch.local as launch

    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    monkeypatch.chdir(tmp_path)
    code, _, out = _refuse_in_process("resume=true", tmp_path / "cell")
    line = " ".join(out.split())
    assert code == 2 and "resume=True" in line and "--multirun" in line, line
    assert not (tmp_path / "cell").exists()


def test_a_shuffled_sweep_runs_its_jobs_in_the_order_zeroexps_check_numbered_them(tmp_path, monkeypatch):
    """``shuffle(...)`` is shuffled by each expansion of the sweep (Python's unseeded ``random``): zeroexp's check
    (``sweep_jobs``: its job numbers, ``.duplicate_jobs.json``) and Hydra's sweeper see one expansion, so job ``i``
    of the check is ``hydra.job.num`` ``i`` of the run, in batches too. No cell runs: the task only records."""
    from hydra.core.hydra_config import HydraConfig

    import zeroexp.cli.run as run
    import zeroexp.cli.sweep as sweep

    checked: list[list[list[str]]] = []
    original = sweep.sweep_jobs
    monkeypatch.setattr(sweep, "sweep_jobs", lambda *a, **k: checked.append(original(*a, **k)) or checked[-1])
    ran: dict[int, list[str]] = {}
    monkeypatch.setattr(run, "task", lambda cfg: ran.setdefault(int(HydraConfig.get().job.num),
                                                                list(HydraConfig.get().overrides.task)))
    proc = run_cli("--multirun", "seed=shuffle(range(0,7))", "logger=none", "world_size=2", "model.width=8",
                   "hydra.sweeper.max_batch_size=3", f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(checked) == 1 and len(checked[0]) == 7, checked
    assert sorted(ran) == list(range(7)) and [ran[i] for i in range(7)] == checked[0], (ran, checked)


def test_a_cell_that_cannot_fit_this_machine_is_refused(tmp_path, monkeypatch, compose):
    """4096 local ranks: refused in one line naming world_size and the estimate (exit 2, no rank, no directory);
    resources.check=false lets it through; too few open files is refused too."""
    import zeroexp.launch.local as launch
    import zeroexp.config.resources as resources
    from zeroexp.config.schemas import ConfigError, validate

    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    monkeypatch.chdir(tmp_path)
    code, seconds, out = _refuse_in_process("world_size=4096", tmp_path / "cell")
    assert code == 2 and seconds < 10, (code, seconds, out)
    line = " ".join(out.split())
    assert "world_size=4096" in line and "4096 ranks need an estimated" in line and "GiB" in line, line
    assert "available" in line and "resources.check=false" in line and "Traceback" not in out, line
    assert not (tmp_path / "cell").exists()
    validate(compose("world_size=4096", "resources.check=false"))  # for those who mean it
    validate(compose("world_size=4096", "dry_run=true"))  # one process: nothing to fit
    monkeypatch.setattr(resources, "_soft", lambda limit: 100 if limit == resources.resource.RLIMIT_NOFILE else None)
    with pytest.raises(ConfigError, match="world_size=64.*open files"):
        validate(compose("world_size=64", "model.width=8"))


# A rank that raises, is killed, hangs or runs out of memory, a full disk while writing results, Ctrl-C, SIGTERM,
# SIGHUP and SIGKILL to the main process, a stale sweep directory resumed: tests/test_fault_matrix.py.


def test_a_rank_error_reaches_the_user_as_one_line_without_tensor_values(tmp_path):
    """A rank's exception whose message holds a parameter's repr: the terminal and the manifest get one line with
    ``<tensor>`` in its place, naming the rank and its log file; the numbers stay in the rank's log only."""
    cell = tmp_path / "cell"
    proc = run_cli("logger=none", "world_size=2", "model.width=32", "steps=9", "timeout.collective_s=4",
                   "timeout.grace_s=1", f"hydra.run.dir={cell}", cwd=tmp_path,
                   env=_env(ZEROEXP_FAULT="1:4:raise_tensor"))  # python -m zeroexp, in this process
    assert proc.returncode == 1, proc.stdout + proc.stderr
    error = read_json(cell / "manifest.json")["error"]
    message = error["message"]
    assert error["rank"] == 1 and error["cause"] == "exception"
    assert message.startswith("rank 1: RuntimeError: injected fault") and "logs/rank1.log" in message, message
    assert "\n" not in message and "<tensor>" in message and "tensor(" not in message, message
    assert "Parameter containing" not in message and "e-0" not in message, message
    line = next(ln for ln in proc.stdout.splitlines() if "injected fault" in ln)
    assert "tensor(" not in proc.stdout and "<tensor>" in proc.stdout, proc.stdout
    assert "rank1.log" in line or "rank1.log" in proc.stdout
    assert "tensor(" in (cell / "logs" / "rank1.log").read_text()  # the rest is in the rank's log


def _sweep(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m zeroexp --multirun`` of three small cells, in this process (conftest.run_cli)."""
    return run_cli("--multirun", "strategy=ddp,zro,fsdp_grad_op", "logger=none", "world_size=2", "model.width=32",
                   "steps=9", "timeout.collective_s=4", "timeout.grace_s=1", f"hydra.sweep.dir={tmp_path}/sweep", *args,
                   cwd=tmp_path, env=_env(**env))


def test_a_sweep_survives_a_failed_cell_and_resumes_it(tmp_path):
    proc = _sweep(tmp_path, ZEROEXP_FAULT="0:4:raise:zro")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the failure is reported at the end
    manifests = {p.parent.name.split("_")[0]: read_json(p) for p in (tmp_path / "sweep").glob("*/manifest.json")}
    assert {k: m["status"] for k, m in manifests.items()} == {"ddp": "ok", "zro": "failed", "fsdp": "ok"}
    assert "injected fault" in proc.stdout
    zro_dir = next((tmp_path / "sweep").glob("zro_*"))
    assert not (zro_dir / "summary.json").exists()
    ddp_started = manifests["ddp"]["started_at"]

    proc = _sweep(tmp_path, "resume=true")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok in an earlier run of this sweep") == 2
    after = {p.parent.name.split("_")[0]: read_json(p) for p in (tmp_path / "sweep").glob("*/manifest.json")}
    assert all(m["status"] == "ok" for m in after.values())
    assert after["ddp"]["started_at"] == ddp_started  # not re-run
    assert (zro_dir / "summary.json").exists() and not list(zro_dir.glob("*.partial"))


#: A tiny LoRA GPT (frozen and trainable parameters in each Block), two ranks, five steps.
LORA = ("model=lora_gpt", "model.n_layer=2", "model.n_embd=32", "model.seq_len=16", "model.vocab_size=64", "steps=5",
        "world_size=2", "logger=none")


def _manifests(sweep: Path) -> dict[str, dict]:
    """The cells' manifests by strategy."""
    return {(m := read_json(p))["cell"]["strategy"]: m for p in sweep.glob("*/manifest.json")}


def test_a_sweep_runs_what_can_run_and_records_a_job_refused_for_its_cell(tmp_path):
    """FSDP1 with use_orig_params=false cannot flatten a unit that mixes frozen and trainable parameters (LoRA's):
    that job alone is refused, recorded with its key and value, listed in the end table and the report; the other
    runs; exit 2. resume=true does not retry the refused job while its configuration is unchanged; with another
    configuration in the same cell directory it is checked again (and refused again)."""
    sweep = tmp_path / "sweep"
    args = ("--multirun", "strategy=ddp,fsdp_full", "strategy.use_orig_params=false", *LORA, f"hydra.sweep.dir={sweep}")
    proc = run_cli(*args, cwd=tmp_path, env=_env(COLUMNS="200"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    manifests = _manifests(sweep)
    assert {k: m["status"] for k, m in manifests.items()} == {"ddp": "ok", "fsdp_full": "refused"}
    refused = manifests["fsdp_full"]
    assert ({k: refused["error"][k] for k in ("rank", "cause", "key", "value")}
            == {"rank": None, "cause": "invalid_config", "key": "strategy.use_orig_params", "value": False})
    assert refused["config"]["strategy"]["use_orig_params"] is False and refused["ranks"] is None
    assert sorted(p.name for p in (sweep / refused["cell_name"]).iterdir()) == ["manifest.json", "zeroexp.log"]
    assert "refused: sweep job #1" in proc.stdout and "2 cells: 1 ok, 1 refused" in proc.stdout
    report = pd.read_csv(sweep / "report.csv").set_index("cell_name")
    assert report.loc[refused["cell_name"], "error.key"] == "strategy.use_orig_params"
    assert "cell refused: (invalid_config)" in (sweep / "report.md").read_text()

    proc = run_cli(*args, "resume=true", cwd=tmp_path, env=_env(COLUMNS="200"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "ok in an earlier run of this sweep" in proc.stdout
    assert "refused in an earlier run of this sweep, its configuration unchanged" in proc.stdout
    assert read_json(sweep / refused["cell_name"] / "manifest.json") == refused  # not retried: untouched

    # another configuration of the same cell (timeouts are not part of its identity): checked again
    proc = run_cli(*args, "resume=true", "timeout.grace_s=2", cwd=tmp_path, env=_env(COLUMNS="200"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    again = read_json(sweep / refused["cell_name"] / "manifest.json")
    assert again["status"] == "refused" and again["config"]["timeout"]["grace_s"] == 2
    assert read_json(sweep / manifests["ddp"]["cell_name"] / "manifest.json") == manifests["ddp"]  # ok: not re-run


@pytest.mark.parametrize("args, first_line", [
    (("strategy=ddp,zro", "offload=optimizer"), "every job of this sweep is refused (2)"),  # each strategy's own
    (("strategy=ddp,zro", "seed=0,-1"), "sweep job #1 (strategy=ddp seed=-1"),  # a bad value: job #0 is valid
    (("model=mlp,custom",), "sweep job #1 (model=custom"),  # a model with nothing to import: job #0 is valid
])
def test_a_sweep_that_would_run_nothing_or_has_an_invalid_config_stops_before_its_first_cell(args, first_line,
                                                                                           tmp_path, monkeypatch):
    import zeroexp.launch.local as launch

    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    proc = run_cli("--multirun", *args, "logger=none", "world_size=2", f"hydra.sweep.dir={tmp_path}/sweep",
                   cwd=tmp_path, env=_env(COLUMNS="200"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert first_line in proc.stdout and "nothing was run" in proc.stdout, proc.stdout
    assert not list((tmp_path / "sweep").glob("*/manifest.json"))


def test_sigterm_stops_a_sweep_and_reports_its_finished_cells(tmp_path):
    """SIGTERM to a sweep's main process: the running cell ends (every rank reaped, ``failed`` naming SIGTERM), no
    further cell starts, and the sweep's report covers the cells that finished; exit 143, nothing left running."""
    from test_fault_matrix import _as_from_a_terminal, session_processes, wait_until_gone

    sweep = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-m", "zeroexp", "--multirun", "strategy=ddp,zro,fsdp_grad_op",
                             "logger=none", "world_size=2", "model.width=32", "steps=9", "timeout.collective_s=600",
                             f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=_env(ZEROEXP_FAULT="0:3:hang:zro"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=_as_from_a_terminal)
    deadline, zro = time.monotonic() + 240, None
    while time.monotonic() < deadline and zro is None:  # ddp done, zro's ranks started (rank 0 hangs at step 3)
        time.sleep(0.3)
        for m in sweep.glob("zro_*/manifest.json"):
            try:
                zro = m.parent if read_json(m).get("ranks") else None
            except json.JSONDecodeError:
                pass
    assert zro is not None, "the second cell never started"
    time.sleep(2)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert "stopped by SIGTERM" in out and "Traceback" not in out, out
    assert wait_until_gone(proc.pid, 30) == [], session_processes(proc.pid)
    manifests = {p.parent.name.split("_")[0]: read_json(p) for p in sweep.glob("*/manifest.json")}
    assert {k: m["status"] for k, m in manifests.items()} == {"ddp": "ok", "zro": "failed"}  # fsdp never started
    assert manifests["zro"]["error"]["signal"] == "SIGTERM"
    report = (sweep / "report.md").read_text()
    assert "ddp" in report and "zro" in report


# Every listening socket of a training local cell is on loopback: asserted in tests/test_fault_matrix.py, by the rows
# that signal a running `python -m zeroexp`, before the signal (no process of its own for that check).


_WRITER = """
import sys
from zeroexp.results.files import write_json
payload = {"status": "ok", "rows": [{"i": i, "x": "y" * 50} for i in range(40000)]}
while True:
    write_json(sys.argv[1], payload)
"""


def test_a_killed_write_never_leaves_a_truncated_file(tmp_path):
    target = tmp_path / "summary.json"
    written = 0
    for delay in (0.3, 0.55, 0.8, 1.1):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(target)])
        deadline = time.monotonic() + 60
        while not target.exists() and time.monotonic() < deadline:  # the writer has started writing
            time.sleep(0.05)
        time.sleep(delay)
        proc.kill()
        proc.wait()
        if target.exists():
            assert json.loads(target.read_text())["status"] == "ok"  # whole, or not there at all
            written += 1
    assert written == 4  # every kill landed while the writer was rewriting an existing file
    write_json(target, {"a": 1})
    assert read_json(target) == {"a": 1}


def test_secrets_never_reach_the_cell_directory(compose, tmp_path, monkeypatch):
    from zeroexp.launch.runner import run_cell

    secret = "s3cr3t-value-0123456789"
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("MY_SERVICE_TOKEN", secret)
    cfg = compose("logger=wandb", "world_size=2", f"checkpoint.dir={secret}")  # a value in the config
    result = run_cell(cfg, tmp_path / "cell")
    assert result.status == "ok", result.error
    files = [p for p in (tmp_path / "cell").rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)
    for p in files:
        data = p.read_bytes()
        assert secret.encode() not in data, p
        assert b"0123456789abcdef0123456789abcdef01234567" not in data, p
