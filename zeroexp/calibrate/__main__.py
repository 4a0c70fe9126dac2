"""``python -m zeroexp.calibrate``: see :mod:`zeroexp.cli.calibrate`."""

from zeroexp.cli.calibrate import main

if __name__ == "__main__":
    from zeroexp.cli.quick_exit import run_then_exit

    run_then_exit(main)  # no interpreter teardown once the work is done (zeroexp.cli.quick_exit)
