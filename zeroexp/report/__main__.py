"""``python -m zeroexp.report SWEEP_DIR [--wandb MODE]``: (re)write a sweep's report; prints report.html last.

Exit codes: 0 the report was written (whatever the cells' verdicts); 1 the report or its W&B run failed;
2 no such sweep directory.
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
                        help="the sweep's W&B run: auto (as the cells logged; default), offline, online, disabled, none")
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
    return 1 if report.wandb_error else 0


if __name__ == "__main__":
    sys.exit(main())
