"""``python -m zeroexp.plan``: see :mod:`zeroexp.plan.cli`."""

from zeroexp.plan.cli import main

if __name__ == "__main__":
    from zeroexp.quick_exit import run_then_exit

    run_then_exit(main)  # no interpreter teardown once the work is done (zeroexp.quick_exit)
