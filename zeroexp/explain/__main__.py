"""``python -m zeroexp.explain``: see :mod:`zeroexp.cli.explain`."""

from zeroexp.cli.explain import main

if __name__ == "__main__":
    from zeroexp.cli.quick_exit import run_then_exit

    run_then_exit(main)  # no interpreter teardown once the work is done (zeroexp.cli.quick_exit)
