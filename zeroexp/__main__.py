"""``python -m zeroexp``: see :mod:`zeroexp.cli`."""

if __name__ == "__main__":
    import sys

    from zeroexp.launch import start_forkserver_for

    start_forkserver_for(sys.argv[1:])  # before this process imports torch, Hydra and the CLI (zeroexp.launch)

from zeroexp.cli import main

if __name__ == "__main__":
    from zeroexp.quick_exit import run_then_exit

    run_then_exit(main)  # no interpreter teardown once the work is done (zeroexp.quick_exit)
