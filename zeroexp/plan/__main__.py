"""``python -m zeroexp.plan``: see :mod:`zeroexp.plan.cli`."""

from zeroexp.plan.cli import main

if __name__ == "__main__":
    main()
