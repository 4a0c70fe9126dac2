"""The cell, validated: what every layer above reads of it, derived once from the composed config.

:mod:`zeroexp.cell.strategy` (each strategy's schema), :mod:`zeroexp.cell.policy` (what an adapter acts on),
:mod:`zeroexp.cell.schedule` (which steps each probe owns), :mod:`zeroexp.cell.identity` (its name and hash) and
:mod:`zeroexp.cell.resolved` (:class:`~zeroexp.cell.resolved.Cell`, all of them and the expectation model's row, knobs
and model shape, as one frozen value). Below the planner, the strategies and the probes, so all of them may read it;
the package itself imports nothing (``--help`` composes with :mod:`zeroexp.cell.strategy` alone).
"""
