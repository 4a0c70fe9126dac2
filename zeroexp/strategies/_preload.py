"""Imports every strategy adapter module. The local launcher's forkserver preloads it (``zeroexp.launch.local``): the
ranks it forks find them imported, where each rank of each cell imported them again (zro's import of
``torch.distributed.optim`` compiles TorchScript: about a second per rank on a 2-core host)."""

from zeroexp.strategies import registered

registered()
