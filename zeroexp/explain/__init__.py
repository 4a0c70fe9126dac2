"""``python -m zeroexp.explain``: two finished cells side by side; see :mod:`zeroexp.cli.explain`."""
