"""The start of ``python -m zeroexp``: the ranks' forkserver starts before this process imports torch, Hydra and
the CLI, when the command line will fork local ranks (zeroexp.launch.local.runs_local_ranks); the benchmark of what it
saves is benchmarks/startup.py (docs/benchmarks.md, start-up)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from zeroexp.launch.local import runs_local_ranks

MAIN = Path(__file__).resolve().parent.parent / "zeroexp" / "__main__.py"


@pytest.mark.parametrize("argv, forks", [
    ([], True),
    (["strategy=fsdp_full", "prefetch=post"], True),
    (["--multirun", "strategy=ddp,zro"], True),
    (["-m", "seed=0,1"], True),
    (["launcher=local"], True),
    (["experiment=dry_run_7b"], True),  # a dry run forks its one process from the forkserver too
    (["launcher=torchrun"], False),     # this process is one of torchrun's ranks
    (["launcher=slurm", "--multirun"], False),
    (["+launcher=slurm"], False),
    (["--help"], False), (["-h"], False), (["--hydra-help"], False), (["--version"], False),
    (["--cfg", "job"], False), (["-c", "all"], False), (["--cfg=job"], False),
    (["--info"], False), (["-i", "config"], False), (["--shell-completion", "query=a"], False),
])
def test_which_command_lines_start_the_forkserver_first(argv, forks):
    assert runs_local_ranks(argv) is forks


def test_python_m_zeroexp_starts_it_before_importing_the_cli():
    """In ``zeroexp/__main__.py``, the first statement run as ``__main__`` starts the forkserver (for its argv), and
    nothing before it imports more than the stdlib and zeroexp.launch.local."""
    tree = ast.parse(MAIN.read_text())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    first = body[0]
    assert isinstance(first, ast.If) and ast.unparse(first.test) == "__name__ == '__main__'"
    imports = [ast.unparse(n) for n in first.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert imports == ["import sys", "from zeroexp.launch.local import start_forkserver_for"]
    calls = [ast.unparse(n.value) for n in first.body if isinstance(n, ast.Expr)]
    assert calls == ["start_forkserver_for(sys.argv[1:])"]
    later = [ast.unparse(n) for n in body[1:] if isinstance(n, ast.ImportFrom)]
    assert later == ["from zeroexp.cli.run import main"]


def test_the_launcher_preloads_what_a_wandb_run_start_imports_before_torch(tmp_path):
    """``wandb.init`` imports W&B's launch inputs (1.4 to 2 s after torch: docs/benchmarks.md); the launching process,
    which logs the cell's run, imports them before validation imports torch (zeroexp.launch.wandb_preload, once
    the config's own keys passed: a refusal of a key pays none of it); the ranks import no W&B. Checked in fresh
    interpreters: that module imports no torch, and an offline ``wandb.init`` imports nothing of W&B beyond what
    it preloads under ``wandb.sdk.launch``, so the preload goes stale loudly if W&B moves it."""
    import inspect
    import subprocess
    import sys

    from zeroexp.launch.local import FORKSERVER_PRELOAD
    from zeroexp.config.schemas import validate
    from zeroexp.launch.runner import _preload_wandb, run_cell

    assert not any("wandb" in m for m in FORKSERVER_PRELOAD)
    assert "import zeroexp.launch.wandb_preload" in inspect.getsource(_preload_wandb)
    assert "before_torch=_preload_wandb" in inspect.getsource(run_cell)
    body = inspect.getsource(validate)
    assert body.index("before_torch()") < body.index("check_model(cfg)")
    code = """
import sys
import zeroexp.launch.wandb_preload
assert "torch" not in sys.modules, "the preload imports torch"
before = {m for m in sys.modules if m.startswith("wandb.sdk.launch")}
import wandb
run = wandb.init(mode="offline", dir=sys.argv[1], project="zeroexp-preload-test")
run.finish()
print(sorted({m for m in sys.modules if m.startswith("wandb.sdk.launch")} - before))
"""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("WANDB")}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
