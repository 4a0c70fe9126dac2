"""``python -m zeroexp.checkpoint``: see :mod:`zeroexp.cli.checkpoint`."""

from zeroexp.cli.checkpoint import main

if __name__ == "__main__":
    from zeroexp.cli.quick_exit import run_then_exit

    run_then_exit(main)  # no interpreter teardown once the work is done (zeroexp.cli.quick_exit)
