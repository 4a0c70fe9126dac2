"""zeroexp: what each data-parallel sharding strategy keeps, sends, peaks at, and computes, per rank."""

__version__ = "0.1.0"
