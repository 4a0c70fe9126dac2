"""Shared fixtures: compose real configs and shrink them; run each distinct cell once per test session.

``cell(*overrides)`` runs the cell that the overrides compose (on top of :data:`BASE`) and caches its
:class:`~zeroexp.launch.runner.CellResult` by the composed config, so tests of different probes that look at the same
cell share one run. ``ladder_sweep`` and ``failed_sweep`` run two small CLI sweeps (through the CLI's entry point, in
the test process) once per session for every module that asserts on a sweep's files or output.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

# One OpenMP thread in the test processes and in every process they start (a CLI test's fresh interpreter, the ranks'
# forkserver: a rank then sets its own, zeroexp.rank.worker), set before torch's import sizes the pool: a second
# thread spins beside the other worker's busy core (one rank of N played on the CPU: 1.5 s with one, 5-7 s with
# torch.set_num_threads(1) called after the import, on the same loaded host).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No store of the planner's answers on disk (zeroexp.cell.store) in the tests and the processes they start: each test
# computes what it checks (a test that monkeypatches a trace must not read another's answer); tests/test_answer_store.py
# opens one of its own.
os.environ["ZEROEXP_CACHE_DIR"] = "off"
# No calibration of the user's (outputs/calibration/ of the working directory) reaches the suite's cells or the
# processes it starts: they look in an empty directory of the session's own (zeroexp.results.calibration.ENV); a
# test that wants one names it (calibration=PATH) or sets the variable itself.
_NO_CALIBRATION = tempfile.mkdtemp(prefix="zeroexp-no-calibration-")
atexit.register(shutil.rmtree, _NO_CALIBRATION, True)
os.environ["ZEROEXP_CALIBRATION_DIR"] = _NO_CALIBRATION

import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from zeroexp.cli.run import CONF_DIR, register
from zeroexp.launch.local import FORKSERVER_PRELOAD, rank_context
from zeroexp.launch.runner import CellResult, run_cell
from zeroexp.strategies import registered

# One intra-op thread in the test process, as each rank of a cell on this 2-core machine has (zeroexp.rank.worker): with
# two, the in-process tests' small torch ops spin-waited for a descheduled peer thread whenever the cores were busy
# (test_reference_arithmetics_differ_by_rounding_only: 179 s with two threads, 1.5 s with one, run one after the other
# on the same loaded host).
torch.set_num_threads(1)

# The suite runs about 30 DeepSpeed cells: its ranks' forkserver imports DeepSpeed once, before the freeze of
# zeroexp.launch.rank_preload (last), where each rank of each DeepSpeed cell imported it (its muon optimizer module
# compiles with torch.compile's machinery: 1.0 s of a 2.9 s rank, quiet host). Likewise the corpus's foreign models'
# modules (tests/test_corpus.py, about 50 cells): PyTorch's test Transformer (common_dtensor pulls torch's test
# utilities, 2.2 s of imports) and Hugging Face's BERT and Llama (2.0 s), which each rank of each such cell imported
# when it built its model (about 1 s a cell less with them preloaded, 2 ranks, loaded host). A user's forkserver does
# not: a single cell would wait for them. Each is optional: a name that does not import, the forkserver skips.
# Every strategy adapter imported once, here: the tests that fork ranks themselves (mp.start_processes, fork) hand them
# to each rank imported, as the ranks' forkserver does for a cell (composing a config imports none).
registered()

rank_context().set_forkserver_preload([*FORKSERVER_PRELOAD[:-1], "deepspeed.runtime.zero.muon.muon_optimizer",
                                       "torch.testing._internal.distributed._tensor.common_dtensor",
                                       "transformers.models.bert.modeling_bert",
                                       "transformers.models.llama.modeling_llama", FORKSERVER_PRELOAD[-1]])

#: The suite's cells' measurement windows (zeroexp.cell.schedule): warm-up 2 (the least any strategy takes: DDP's
#: steady fingerprint; the product's default is 3), one profiled step and one memory-tracked step (the product's
#: default is two of each; every check reads one), then the steps left are timed.
WARMUP = 2
WINDOWS = (f"warmup_steps={WARMUP}", "probes.profile_steps=1", "probes.memory_steps=1")
#: The steps the windows take: a cell of PROBED steps has every probe but timing (n/a: no step left to time).
PROBED = WARMUP + 2
#: Shrinks every test cell: no W&B unless a test asks for it, a small 8-layer Linear stack, two steps timed (the least
#: the timing probe takes).
STEPS = PROBED + 2
BASE = ("logger=none", "model.width=64", f"steps={STEPS}", *WINDOWS)
#: A Hugging Face Llama from its config, shrunk (2 layers of width 32, grouped-query attention, 8 tokens).
HF_LLAMA = ("model=hf", "model.arch=llama", "model.vocab_size=64", "model.hidden_size=32", "model.num_hidden_layers=2",
            "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.intermediate_size=64",
            "model.max_position_embeddings=16", "model.seq_len=8")


class _Composer:
    """Hydra's ``compose``, each defaults list merged once per process.

    Hydra composes in two parts (``ConfigLoaderImpl._load_configuration_impl``): the overrides that name a config
    group (``strategy=zro``, ``experiment=zero_ladder``) pick the defaults list, whose configs it loads and merges;
    the others (``world_size=2``, ``strategy.reduce=allreduce``, ``+x=1``, ``~y``) it then applies, in their order,
    to the merged config with ``ConfigLoaderImpl._apply_overrides_to_config``. The suite composes about a thousand
    configs over about 150 defaults lists, and the merge is most of a compose (0.3 s here each, a fifth of the
    parallel phase's time): this merges each defaults list once, through Hydra, and applies the other overrides to a
    copy with Hydra's own function, after splitting them as Hydra does (``defaults_list.Overrides``: a group override
    is one whose key is a group of the repository and whose value is not a dict). A sweep override or one of
    ``hydra.*`` goes to Hydra whole. tests/test_config_keys.py checks it against Hydra's compose on a grid."""

    def __init__(self) -> None:
        self._merged: dict[tuple[str, tuple[str, ...]], DictConfig] = {}
        self._is_group: dict[str, bool] = {}
        self._parser: Any = None

    def __call__(self, overrides: list[str] | tuple[str, ...], config_name: str = "config") -> DictConfig:
        import copy

        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser

        register()
        self._parser = self._parser or OverridesParser.create()
        parsed = self._parser.parse_overrides(list(overrides))
        whole = any(o.is_sweep_override() or o.key_or_group.replace("/", ".").split(".")[0] == "hydra" for o in parsed)
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            if whole:
                return hydra_compose(config_name=config_name, overrides=list(overrides))
            repo = GlobalHydra.instance().config_loader().repository
            for o in parsed:
                if o.key_or_group not in self._is_group:
                    self._is_group[o.key_or_group] = repo.group_exists(o.key_or_group)
            group = [self._is_group[o.key_or_group] and not isinstance(o.value(), dict) for o in parsed]
            key = (config_name, tuple(o.input_line for o, g in zip(parsed, group) if g))
            if key not in self._merged:
                self._merged[key] = hydra_compose(config_name=config_name, overrides=list(key[1]))
        cfg = copy.deepcopy(self._merged[key])
        ConfigLoaderImpl._apply_overrides_to_config([o for o, g in zip(parsed, group) if not g], cfg)
        return cfg


#: ``compose_config(["strategy=zro", "world_size=2"])`` -> what Hydra's ``compose`` returns (the hydra node removed).
compose_config = _Composer()


@pytest.fixture(scope="session")
def compose() -> Callable[..., DictConfig]:
    """``compose("strategy=zro", "world_size=2")`` -> the composed config (BASE applied first)."""

    def _compose(*overrides: str, base: tuple[str, ...] = BASE) -> DictConfig:
        return compose_config([*base, *overrides])

    return _compose


def _run_once_across_workers(cfg: DictConfig, key: str, shared: Path) -> CellResult:
    """The cell of ``cfg`` (its YAML: ``key``) run by whichever pytest-xdist worker of this session asks first; a
    worker that asks while another runs it waits for it (an exclusive lock per cell), then reads its result. The
    modules run on two workers (Makefile) and several assert on the same cells (test_plan's are test_state's and
    test_memory_timing_equivalence's...): 28 of 195 cells ran twice, 122 s. The cell's files are shared as within
    one worker; a test does not change them."""
    import fcntl
    import hashlib
    import pickle
    import shutil

    shared.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    done = shared / f"{digest}.pkl"
    with open(shared / f"{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this worker dies
        if done.exists():
            return pickle.loads(done.read_bytes())
        shutil.rmtree(shared / digest, ignore_errors=True)  # what a worker that died while running it left
        result = run_cell(cfg, shared / digest)
        part = done.with_suffix(".part")
        part.write_bytes(pickle.dumps(result))
        part.replace(done)
        return result


@pytest.fixture(scope="session")
def cell(compose, tmp_path_factory) -> Callable[..., CellResult]:
    """Run (once per session, across pytest-xdist workers too) the cell given by the overrides; returns its
    CellResult."""
    composed: dict[tuple[str, ...], tuple[DictConfig, str]] = {}
    cache: dict[str, CellResult] = {}
    root = tmp_path_factory.mktemp("cells")
    # Under xdist: beside the workers' base temp dirs (popen-gw<i>), named by the session's run id, so that no other
    # session's results are ever read.
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") if os.environ.get("PYTEST_XDIST_WORKER") else None
    shared = tmp_path_factory.getbasetemp().parent / f"cells-{run}" if run else None

    def _cell(*overrides: str, base: tuple[str, ...] = BASE) -> CellResult:
        spelled = (*base, "|", *sorted(overrides))  # group choices apply before values: order is irrelevant
        if spelled not in composed:
            cfg = compose(*overrides, base=base)
            composed[spelled] = cfg, OmegaConf.to_yaml(cfg)
        cfg, key = composed[spelled]  # the composed config, not its spelling: a default spelled out
        if key not in cache:          # ("prefetch=pre", "world_size=4") is the same cell, run once
            cache[key] = (_run_once_across_workers(cfg, key, shared) if shared
                          else run_cell(cfg, root / f"cell{len(cache):03d}"))
        return cache[key]

    return _cell


REPO = Path(__file__).resolve().parent.parent
#: The small sweep of the ZeRO ladder at N=2 that several modules assert on (reports, multirun de-duplication, W&B
#: runs, progress lines): 12 jobs, 6 distinct cells (prefetch applies to fsdp_full only), run once per session.
LADDER_SWEEP = ("strategy=ddp,zro,fsdp_grad_op,fsdp_full", "prefetch=pre,post,none", "logger=wandb")
#: The shapes of the shared sweeps (as BASE shrinks the cells of ``cell``).
SWEEP_SMALL = ("world_size=2", "model.width=64", f"steps={STEPS}", *WINDOWS)


def _sweep_env(fault: str | None = None) -> dict[str, str]:
    """This environment without its W&B settings and injected faults, 200 columns wide; ``fault``: zeroexp.rank.faults'
    ZEROEXP_FAULT."""
    from zeroexp.rank.faults import ENV as FAULT_ENV

    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV and not k.startswith("WANDB")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["COLUMNS"] = "200"  # rich wraps at the terminal's width, 80 without one: each message on one line, as read
    return {**env, FAULT_ENV: fault} if fault else env


def run_cli(*argv: str, app: str = "zeroexp.cli.run", cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m zeroexp <argv>`` (or ``python -m zeroexp.plan``: ``app="zeroexp.cli.plan"``) through the app's
    real entry point, ``main()``, in this process, reported as :func:`subprocess.run` reports it (exit code, stdout,
    stderr): the same code path without an interpreter start-up (seconds of imports) per case. A cell it runs
    forks its ranks from this process's forkserver. ``env`` replaces the environment and ``cwd`` the working
    directory for the call; both, and ``sys.argv``, are restored after it."""
    import contextlib
    import importlib
    import io

    from hydra.core.global_hydra import GlobalHydra

    module = importlib.import_module(app)
    for flag in ("_TASK_STARTED", "_STARTED"):  # "a task ran": a composition error before it is bad input, exit 2
        if hasattr(module, flag):
            setattr(module, flag, False)
    getattr(module, "_RAN_THIS_INVOCATION", set()).clear()  # a sweep's cells so far: a fresh process has none
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_env, saved_cwd = sys.argv, dict(os.environ), os.getcwd()
    sys.argv = [app, *argv]
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    GlobalHydra.instance().clear()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            module.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        GlobalHydra.instance().clear()
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
    return subprocess.CompletedProcess([app, *argv], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def ladder_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """:data:`LADDER_SWEEP` through the CLI's entry point in this process (:func:`run_cli`), once per session: its
    directory and the exit code and output. In a process of its own it cost an interpreter and a forkserver more
    (imports: 39 s against 20 s for the fixture on the loaded host); a fresh ``python -m zeroexp`` sweep is still run
    as a user runs it by tests/test_reliability.py (SIGTERM to a sweep) and tests/test_cluster.py (the submitit sweep,
    its report), and a fresh cell with W&B by tests/test_fault_matrix.py."""
    sweep_dir = tmp_path_factory.mktemp("ladder_sweep") / "sweep"
    return sweep_dir, run_cli("--multirun", *LADDER_SWEEP, *SWEEP_SMALL, f"hydra.sweep.dir={sweep_dir}",
                              cwd=sweep_dir.parent, env=_sweep_env())


@pytest.fixture(scope="session")
def failed_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """ddp ok and zro failing on purpose at step 4 (N=2, no W&B), once per session, through the CLI's entry point
    in this process, as the ladder sweep: its directory and the exit code and output.
    Read it only; copy it to change it."""
    sweep_dir = tmp_path_factory.mktemp("failed_sweep") / "sweep"
    return sweep_dir, run_cli("--multirun", "strategy=ddp,zro", "logger=none", *SWEEP_SMALL,
                              f"hydra.sweep.dir={sweep_dir}", cwd=sweep_dir.parent, env=_sweep_env("0:4:raise:zro"))


def held_checks(result: CellResult) -> dict[str, Any]:
    """A cell that ran, its checks by name (``zeroexp.report.checks.cell_checks``), every one asserted PASS, n/a or
    SKIP."""
    from zeroexp.report.checks import cell_checks

    assert result.status == "ok", result.error
    checks = {c.name: c for c in cell_checks(result.summary)}
    assert not [(c.name, c.reasons) for c in checks.values() if c.verdict not in ("PASS", "n/a", "SKIP")]
    return checks


def read_csv(result: CellResult, name: str):
    import pandas as pd

    return pd.read_csv(Path(result.cell_dir) / name)


#: What starts rank processes (or a whole `python -m zeroexp`): a test that does, itself or through a fixture, is
#: ``slow``; ``pytest -m "not slow"`` is the edit-test loop's fast subset (README, Tests).
_SPAWNS = re.compile(r"\brun_cell\(|(?<![\w.])cell\(|\bmp\.spawn\(|\bstart_processes\(|\bsubprocess\.|"
                     r"\blaunch_local\(|\brun_dry\(|\bmain\(\)|\brun_cli\(")


@functools.lru_cache(maxsize=None)
def _starts_processes(func, depth: int = 3) -> bool:
    """Whether ``func``'s body, or a function of its module it calls (``depth`` levels down), starts processes (asked
    once per function: the items of a parametrized test, and the tests that share a fixture, share the answer)."""
    import inspect

    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    body = source.split(":", 1)[-1]  # not the signature: a fixture named `cell` in it is checked by itself
    if _SPAWNS.search(body):
        return True
    helpers = [f for name, f in vars(inspect.getmodule(func) or object).items()  # the test module's own helpers
               if inspect.isfunction(f) and f is not func and f.__module__ == func.__module__
               and re.search(rf"(?<![\w.]){re.escape(name)}\(", body)]
    return depth > 0 and any(_starts_processes(f, depth - 1) for f in helpers)


@pytest.fixture(scope="session", autouse=True)
def _one_invocation():
    """The test session is one invocation (zeroexp.cell.memo): what it computes once about a model (its shape, traced
    step, op counts, the model check) it keeps, as a sweep or a recommend does; a test that counts builds opens a
    fresh memo (``invocation_memo(fresh=True)``)."""
    from zeroexp.cell.memo import invocation_memo

    with invocation_memo():
        yield


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: starts rank processes (a cell, a sweep, the CLI); deselect with "
                                       "-m 'not slow'")
    config.addinivalue_line("markers", "serial: signals a fresh `python -m zeroexp` or bounds its time in seconds "
                                       "(the fault matrix, the reliability rows): `make test` runs these in a pytest "
                                       "run of their own, beside the others at a higher priority (Makefile)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/test_cuda.py; benchmarks/gpu_check.sh "
                                       "runs these)")


#: Session fixtures several modules read: on pytest-xdist (``-n 2 --dist loadfile``, as ``make test`` runs the suite)
#: the modules that use one run on one worker, as one unit, so that each runs once.
SHARED_SESSION_FIXTURES = ("ladder_sweep", "failed_sweep")


@functools.lru_cache(maxsize=None)
def _reads_shared_fixtures(module: str) -> bool:
    """Whether the test module (a path from the repository's root) names a fixture of SHARED_SESSION_FIXTURES."""
    try:
        text = (REPO / module).read_text()
    except OSError:
        return False
    return any(re.search(rf"\b{name}\b", text) for name in SHARED_SESSION_FIXTURES)


try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # without pytest-xdist the suite runs in one process
    pass
else:
    class _ModulesSharingFixtures(LoadFileScheduling):
        """``--dist loadfile`` with one exception: the modules that read a shared session sweep are one unit. (pytest-
        xdist's ``loadgroup`` would do it by marker, but its 3.8 release sets a node id attribute pytest 9 no longer
        reads: the groups are silently ignored.)"""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "modules reading the shared sweeps" if _reads_shared_fixtures(module) else module

    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") != "loadfile":
            return None
        config.option.loadscopereorder = False  # the units in collection order: the costliest modules first (below)
        return _ModulesSharingFixtures(config, log)


#: Each test module's seconds in the last whole run measured (``ZEROEXP_SUITE_DURATIONS=tests/durations.json make
#: test`` writes it): the modules are collected costliest first, so that the workers of ``--dist loadfile`` take the
#: long ones early and end together (by test count, xdist's default order, a 30-s module of one test came last: a
#: 26-s tail with one worker idle). A hint only: a module it lacks comes after those it has, in its own order.
DURATIONS = REPO / "tests" / "durations.json"
_COST = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}) or {}
        funcs = [getattr(item, "function", None), *(d.func for ds in defs.values() for d in ds)]
        if any(f is not None and _starts_processes(f) for f in funcs):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: -_COST.get(item.nodeid.split("::", 1)[0], 0.0))  # stable: a module's own order kept


_SPENT: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    if os.environ.get("ZEROEXP_SUITE_DURATIONS"):
        module = report.nodeid.split("::", 1)[0]
        _SPENT[module] = _SPENT.get(module, 0.0) + report.duration


def pytest_sessionfinish(session) -> None:
    """With ``ZEROEXP_SUITE_DURATIONS=<path>``: each module's seconds (setup, call and teardown of its tests, as the
    workers reported them) into ``path``, over what it holds of other modules (``make test``'s two runs, the serial
    one ending first), costliest first, for :data:`DURATIONS`."""
    path = os.environ.get("ZEROEXP_SUITE_DURATIONS")
    if path and _SPENT and not hasattr(session.config, "workerinput"):
        held = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
        ranked = sorted({**held, **_SPENT}.items(), key=lambda kv: -kv[1])
        Path(path).write_text(json.dumps({m: round(s, 1) for m, s in ranked}, indent=0) + "\n")


def assert_threshold_rule(eq: dict) -> None:
    """The equivalence probe's threshold rule, whatever the floor this CPU measured: ten floors when they exceed the
    precision's threshold (basis ``reduction-order floor``), else the precision's."""
    assert eq["reduction_floor"] >= 0, eq
    if 10 * eq["reduction_floor"] > eq["threshold"]:
        assert eq["threshold_basis"] == "reduction-order floor", eq
        assert eq["effective_threshold"] == 10 * eq["reduction_floor"], eq
    else:
        assert (eq["threshold_basis"], eq["effective_threshold"]) == ("precision", eq["threshold"]), eq

#: The peak model's gradient flows as phase_peaks' flags (a family's ``flow``).
FLOW = {"new": {}, "in_place": {"live_grads": True}, "bucket": {"live_grads": True, "open_buckets": True}}
