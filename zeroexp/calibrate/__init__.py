"""``python -m zeroexp.calibrate``: measure this machine's collectives and compute once, apart from any cell; every
cell's ``plan.time`` and the planner's ``network=this_machine`` predict step times from the file it writes
(:mod:`zeroexp.results.calibration`). Its command line: :mod:`zeroexp.cli.calibrate`."""
