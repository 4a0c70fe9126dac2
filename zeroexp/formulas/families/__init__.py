"""Strategy families: one module per family, each owning what its strategies do with a model's state (groups, state
bytes, overlap, framework cost, phase peaks, init peak) and its rows (:class:`~zeroexp.formulas.layout.StateLayout`:
a label, a stage, a family and its flags). Outside this package nothing compares a family's discriminator: a
consumer asks the row's family (``row.family``).

- :mod:`~zeroexp.formulas.families.base`: what a family answers (:class:`Family`), for a row of no model;
- :mod:`~zeroexp.formulas.families.paper`: the ZeRO paper's stages (reference rows);
- :mod:`~zeroexp.formulas.families.ddp`: DDP's buckets; :mod:`~zeroexp.formulas.families.zro`:
  ZeroRedundancyOptimizer's owners on DDP;
- :mod:`~zeroexp.formulas.families.zero`: zeroexp's ZeRO-1/2 buckets;
- :mod:`~zeroexp.formulas.families.fsdp1`: FSDP1's flat units; :mod:`~zeroexp.formulas.families.fsdp2`: FSDP2's
  per-parameter rows (what they share: ``_fsdp``);
- :mod:`~zeroexp.formulas.families.deepspeed`: DeepSpeed's partitions.

A strategy in an existing family is an adapter, its schema and YAML, and a row in its family's ``ROWS``; a new family
is one more module here (and its tests).
"""

from zeroexp.formulas.families.base import NO_FAMILY, Family

__all__ = ["Family", "NO_FAMILY"]
