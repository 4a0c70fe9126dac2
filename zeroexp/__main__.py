"""``python -m zeroexp``: see :mod:`zeroexp.cli.run`."""

if __name__ == "__main__":
    import sys

    from zeroexp.launch.local import start_forkserver_for

    start_forkserver_for(sys.argv[1:])  # before this process imports torch, Hydra and the CLI (zeroexp.launch.local)

from zeroexp.cli.run import main

if __name__ == "__main__":
    from zeroexp.cli.quick_exit import run_then_exit

    run_then_exit(main)  # no interpreter teardown once the work is done (zeroexp.cli.quick_exit)
