"""``python -m zeroexp.checkpoint``: converting kept checkpoints offline; see :mod:`zeroexp.cli.checkpoint`."""
