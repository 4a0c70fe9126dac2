"""Cells whose ranks someone else starts: torchrun (any number of nodes) or SLURM through Hydra's submitit
launcher (``launcher=torchrun|slurm``, docs/cluster.md). :mod:`zeroexp.launch.cluster.env` reads a rank's place from
the launcher's environment; :mod:`zeroexp.launch.cluster.rank` runs one rank into the cell directory all ranks share.
"""
