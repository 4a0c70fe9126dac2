"""``python -m zeroexp.calibrate``: see :mod:`zeroexp.calibrate.cli`."""

from zeroexp.calibrate.cli import main

if __name__ == "__main__":
    main()
