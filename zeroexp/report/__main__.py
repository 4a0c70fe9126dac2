"""``python -m zeroexp.report SWEEP_DIR [--wandb MODE] [--wandb-report]``: (re)write a sweep's report.

Prints the verdicts, then report.html. ``--wandb-report`` also builds the sweep's W&B Report
(``zeroexp.report.wandb_report``): saved, its URL printed, when logged in and not offline; else what it would
create and the commands that create it after ``wandb sync``.

Exit codes: 0 the report was written (whatever the cells' verdicts; offline, the W&B Report only described);
1 the report, its W&B run or saving the W&B Report failed; 2 no such sweep directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zeroexp.report import write_report
from zeroexp.report.wandb_run import MODES


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, write the report, print its verdicts and files."""
    parser = argparse.ArgumentParser(prog="python -m zeroexp.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a sweep directory (outputs/multirun/<time>)")
    parser.add_argument("--wandb", choices=MODES, default="auto",
                        help="the sweep's W&B run: auto (as the cells logged; default), offline, online, disabled, "
                             "none")
    parser.add_argument("--wandb-report", action="store_true",
                        help="also build the sweep's W&B Report (panels over the cells' runs); saved when logged in "
                             "and not offline, else described with the commands that create it")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"error: no sweep directory {args.sweep_dir}", file=sys.stderr)
        return 2
    report = write_report(args.sweep_dir, wandb_mode=args.wandb)
    for line in report.verdicts.lines:
        print(line)
    for line in report.verdicts.failures:
        print(f"FAIL {line}")
    if report.wandb_run_dir is not None:
        print(f"W&B sweep run: {report.wandb_run_dir}")
    if report.wandb_error:
        print(f"error: W&B sweep run failed: {report.wandb_error}", file=sys.stderr)
    print(report.sweep_dir / "report.html")
    failed = bool(report.wandb_error)
    if args.wandb_report:
        failed = not _wandb_report(report) or failed
    return 1 if failed else 0


def _wandb_report(report) -> bool:
    """Build the W&B Report; save it when logged in, else describe it. False when saving failed."""
    from zeroexp.report.wandb_report import build_wandb_report, describe, logged_in, report_target, \
        save_wandb_report, sync_commands

    try:
        built = build_wandb_report(report)
    except ImportError as e:
        print(f"error: the W&B Report needs wandb-workspaces ({e}): pip install -e '.[wandb]'", file=sys.stderr)
        return False
    if not report_target(report.cells)["logged"]:
        print("note: the cells did not log to W&B (logger=wandb): the report's panels will find no runs")
    if logged_in():
        try:
            print(f"W&B Report: {save_wandb_report(built)}")
            return True
        except Exception as e:  # noqa: BLE001 - the local report is written; say what W&B did not get
            print(f"error: saving the W&B Report failed: {type(e).__name__}: {e}", file=sys.stderr)
            return False
    print("offline (no W&B API key, or WANDB_MODE=offline): the W&B Report is not saved. It would be:")
    for line in describe(built):
        print(f"  {line}")
    print("To create it, sync the runs and run this again, online (WANDB_MODE unset):")
    for line in sync_commands(report.sweep_dir):
        print(f"  {line}")
    return True


if __name__ == "__main__":
    from zeroexp.cli.quick_exit import run_then_exit

    run_then_exit(lambda: sys.exit(main()))  # no interpreter teardown once the work is done
