"""Strategy knowledge lives with the strategy: the planner and the formulas read a strategy's row
(``zeroexp.formulas.rows``' ``StateLayout`` fields), never test its name. A test reads the source: no registered
strategy name, nor any row's name, is compared as a string in ``zeroexp/plan`` or ``zeroexp/formulas`` outside the
rows module, which defines each row by name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / "zeroexp"
#: Where names legitimately live: the rows module orders the rows, each family's module names its own.
EXEMPT = {ROOT / "formulas" / "rows.py", *(ROOT / "formulas" / "families").glob("*.py")}


def _strategy_names() -> set[str]:
    """Every registered strategy's name (conf/strategy/*.yaml, the adapters' registry) and every row's name."""
    from zeroexp.formulas import LAYOUTS
    from zeroexp.strategies import registered

    names = {str(yaml.safe_load(p.read_text())["name"]) for p in (REPO / "conf" / "strategy").glob("*.yaml")}
    return names | set(registered()) | set(LAYOUTS)


def _constants(node: ast.AST) -> list[ast.Constant]:
    """The string constants ``node`` is, or holds as the members or keys of a literal tuple, list, set or dict."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [c for e in node.elts for c in _constants(e)]
    if isinstance(node, ast.Dict):
        return [c for k in node.keys if k is not None for c in _constants(k)]
    return []


def name_tests(source: str, names: set[str], compared_only: bool = False) -> list[tuple[int, str]]:
    """(line, name) of each strategy name ``source`` compares against (``==``, ``!=``, ``in``, ``not in``, either
    side, a literal collection's members included) or, unless ``compared_only``, keys a literal dict or collection
    with (a by-name table, read later by a comparison or a lookup)."""
    hits: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        found: list[ast.Constant] = []
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            for side in (node.left, *node.comparators):
                found += _constants(side)
        elif compared_only:
            continue
        elif isinstance(node, (ast.Dict, ast.Tuple, ast.List, ast.Set)):
            found += _constants(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            found += _constants(node.args[0]) if node.args else []  # TABLE.get("name")
        hits += [(c.lineno, c.value) for c in found if c.value in names]
    return sorted(set(hits))


def _sources() -> list[Path]:
    return sorted(p for d in ("plan", "formulas") for p in (ROOT / d).rglob("*.py") if p not in EXEMPT)


def test_the_names_are_known():
    names = _strategy_names()
    assert {"ddp", "zro", "zero1", "zero2", "fsdp_full", "fsdp2_hybrid", "deepspeed", "deepspeed_stage3",
            "fsdp__HYBRID_SHARD_ZERO2", "zero_stage1"} <= names


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_strategy_name_is_compared_as_a_string(path):
    hits = name_tests(path.read_text(), _strategy_names())
    assert not hits, (f"{path.relative_to(REPO)} tests strategy names {hits}: read a field of the row instead "
                      "(zeroexp.formulas.rows.row_of(name), StateLayout)")


@pytest.mark.parametrize("snippet", [
    'if name in ("zero1", "zero2"): pass',
    'x = name == "ddp"',
    'x = "fsdp_full" != name',
    'TABLE = {"fsdp_full": True}',
    'ROWS = ("fsdp_grad_op",)',
    'x = FLOW.get("zro")',
    'x = name not in ["deepspeed_stage1"]',
])
def test_the_check_finds_a_name_test(snippet):
    assert name_tests(snippet, _strategy_names()), snippet


def test_the_check_passes_a_field_test():
    assert name_tests('x = row.family.gathers_units and row.family.groups_kind(row) == "buckets"',
                      _strategy_names()) == []


#: What tells one family from another: its name, how it cuts groups, its peak model's gradient flow
#: (``Family.name``, ``Family.groups_kind``, ``Family.flow``).
def _discriminators() -> set[str]:
    from zeroexp.formulas import LAYOUTS

    out = set()
    for row in LAYOUTS.values():
        out |= {row.family.name, row.family.groups_kind(row), row.family.flow(row)}
    # "none" names no family; "params" (DeepSpeed stage 3's groups) also names a parameter-count plan's model
    return (out - {None, "none", "params"}) | {"replica"}


def _family_sources() -> list[Path]:
    families = ROOT / "formulas" / "families"
    return sorted(p for p in ROOT.rglob("*.py") if families not in p.parents)


def discriminator_tests(source: str, values: set[str]) -> list[tuple[int, str]]:
    """(line, value) of each family discriminator ``source`` compares against (:func:`name_tests`' comparisons)."""
    return name_tests(source, values, compared_only=True)


def test_the_families_discriminators_are_known():
    assert {"ddp", "zro", "zero", "fsdp1", "fsdp2", "deepspeed", "paper", "units", "rows", "buckets", "owners",
            "flat", "new", "in_place", "bucket"} <= _discriminators()


@pytest.mark.parametrize("path", _family_sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_family_discriminator_is_compared_outside_the_families(path):
    hits = discriminator_tests(path.read_text(), _discriminators())
    assert not hits, (f"{path.relative_to(REPO)} compares family discriminators {hits}: ask the row's family "
                      "instead (row.family, zeroexp.formulas.families)")


@pytest.mark.parametrize("snippet", [
    'x = row.peak_flow in ("fsdp1", "fsdp2")',
    'x = layout.groups == "buckets"',
    'x = "units" != kind',
    'x = flow not in ["new", "bucket"]',
])
def test_the_check_finds_a_discriminator_test(snippet):
    assert discriminator_tests(snippet, _discriminators()), snippet
