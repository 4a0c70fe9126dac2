"""``python -m zeroexp.plan``: see :mod:`zeroexp.cli.plan`."""

from zeroexp.cli.plan import main

if __name__ == "__main__":
    from zeroexp.cli.quick_exit import run_then_exit

    run_then_exit(main)  # no interpreter teardown once the work is done (zeroexp.cli.quick_exit)
