"""The validated cell (zeroexp.cell.resolved.Cell): resolved once, with its model's shape, travelling to the ranks;
the invocation's memo (zeroexp.cell.memo) in place of module-global caches; no config key read with a default of the
reader's own (the schema has the default: one place)."""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest

from conftest import compose_config
from zeroexp.cell.memo import _ACTIVE, invocation_memo, memo_table, memoized
from zeroexp.cell.resolved import Cell
from zeroexp.cell.strategy import BUCKET_CAP_MB, SCHEMAS
from zeroexp.config.schemas import validate
from zeroexp.formulas import LAYOUTS, PlanKnobs

ROOT = Path(__file__).resolve().parent.parent / "zeroexp"
BASE = ("logger=none", "world_size=2", "steps=8", "resources.check=false")


def _validated(*overrides: str) -> tuple[object, Cell]:
    cfg = compose_config([*BASE, *overrides])
    return cfg, validate(cfg)


@pytest.mark.parametrize("overrides", [("strategy=zero2", "precision=bf16", "grad_accum=2"),
                                       ("strategy=fsdp2_full", "strategy.reshard_after_forward=null"),
                                       ("strategy=ddp", "model=transformer_layer")])
def test_validate_returns_the_resolved_cell(overrides):
    from zeroexp.models import wrap_paths
    from zeroexp.plan.shape import model_shape

    cfg, cell = _validated(*overrides)
    assert cell.row_name == str(cfg.strategy.layout) and cell.row is LAYOUTS[cell.row_name]
    assert (cell.world_size, cell.grad_accum, cell.precision) == (2, int(cfg.grad_accum), str(cfg.precision.name))
    assert cell.knobs.micro_batches == cell.grad_accum and cell.schedule.grad_accum == cell.grad_accum
    assert (cell.device, cell.backend) == ("cpu", "gloo")
    assert cell.shape == model_shape(cfg.model, wrap_paths(cfg))  # read once, by validation
    assert cell.knobs.root_kept_after_forward == ("reshard_after_forward=null" in " ".join(overrides))
    back = pickle.loads(pickle.dumps(cell))  # the ranks get it by pickle: the row by name, the rest as it was
    assert back.row is cell.row and dataclasses.replace(back, row=None) == dataclasses.replace(cell, row=None)


def test_knobs_read_the_strategys_schema_only():
    """A sweep sets a key for some strategies (bucket_cap_mb for ddp): another strategy's cell ignores it."""
    _, fsdp = _validated("strategy=fsdp_full", "+strategy.bucket_cap_mb=64")
    _, ddp = _validated("strategy=ddp", "strategy.bucket_cap_mb=64")
    _, default = _validated("strategy=zero1")
    assert fsdp.knobs.bucket_cap_bytes == PlanKnobs().bucket_cap_bytes
    assert ddp.knobs.bucket_cap_bytes == 64 * 2**20
    assert default.knobs.bucket_cap_bytes == int(BUCKET_CAP_MB * 2**20) == PlanKnobs().bucket_cap_bytes


def test_bucket_default_is_the_schemas():
    """One default: every bucketed schema's is BUCKET_CAP_MB, and no strategy YAML sets its own."""
    bucketed = [name for name, schema in SCHEMAS.items()
                if "bucket_cap_mb" in {f.name for f in dataclasses.fields(schema)}]
    assert set(bucketed) >= {"ddp", "zro", "zero1", "zero2", "deepspeed"}
    for name in bucketed:
        assert SCHEMAS[name]().bucket_cap_mb == BUCKET_CAP_MB
    conf = ROOT.parent / "conf" / "strategy"
    assert [p.name for p in conf.glob("*.yaml") if any(line.startswith("bucket_cap_mb:")
                                                         for line in p.read_text().splitlines())] == []


def test_memo_belongs_to_an_invocation(monkeypatch):
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    token = _ACTIVE.set(None)  # outside the test session's invocation (conftest)
    try:
        _memo_outside_an_invocation(compute)
    finally:
        _ACTIVE.reset(token)


def _memo_outside_an_invocation(compute) -> None:
    assert memo_table("t") is None and memoized("t", "k", compute) == 1 and memoized("t", "k", compute) == 2
    with invocation_memo() as tables:
        assert memoized("t", "k", compute) == 3 and memoized("t", "k", compute) == 3  # remembered
        with invocation_memo() as inner:  # nested: the same invocation
            assert inner is tables and memoized("t", "k", compute) == 3
        assert memoized("t", None, compute) == 4  # no key: computed
    assert memo_table("t") is None and memoized("t", "k", compute) == 5  # dropped with the invocation


def test_model_shape_is_read_once_per_invocation(monkeypatch):
    import zeroexp.plan.shape as shapes

    built = []
    real = shapes.shape_of
    monkeypatch.setattr(shapes, "shape_of", lambda *a, **k: built.append(1) or real(*a, **k))
    model = compose_config(list(BASE)).model
    token = _ACTIVE.set(None)  # outside the test session's invocation (conftest)
    try:
        shapes.model_shape(model)
        shapes.model_shape(model)
        assert len(built) == 2  # no invocation: nothing kept between calls
        with invocation_memo():
            first, second = shapes.model_shape(model), shapes.model_shape(model)
        assert len(built) == 3 and first is second
    finally:
        _ACTIVE.reset(token)


# -- What the code may not do ------------------------------------------------------------------------------------------


def _schema_keys() -> set[str]:
    """Every key of the run's, the planner's and the recommender's schemas and of every strategy's schema."""
    import zeroexp.cli.plan as plan_cli
    import zeroexp.cli.recommend as recommend_cli
    import zeroexp.config.schemas as run_schemas

    keys: set[str] = set()
    for module in (run_schemas, plan_cli, recommend_cli):
        for value in vars(module).values():
            if dataclasses.is_dataclass(value) and isinstance(value, type):
                keys |= {f.name for f in dataclasses.fields(value)}
    for schema in SCHEMAS.values():
        keys |= {f.name for f in dataclasses.fields(schema)}
    return keys


def _config_receiver(node: ast.AST) -> bool:
    """``cfg``, ``ctx.cfg``, ``self.cfg``, ``cfg.strategy``...: a composed config or one of its groups."""
    text = ast.unparse(node)
    return text.split(".")[0] == "cfg" or ".cfg" in text


def defaulted_reads(source: str, keys: set[str]) -> list[str]:
    """``cfg.get("key") or default`` and ``cfg.get("key", default)`` of a schema key, as source text."""
    found = []
    for node in ast.walk(ast.parse(source)):
        calls = []
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and isinstance(node.values[0], ast.Call):
            calls.append((node.values[0], node))
        if isinstance(node, ast.Call) and len(node.args) == 2:
            calls.append((node, node))
        for call, whole in calls:
            f = call.func
            if (isinstance(f, ast.Attribute) and f.attr == "get" and _config_receiver(f.value) and call.args
                    and isinstance(call.args[0], ast.Constant) and call.args[0].value in keys):
                found.append(ast.unparse(whole))
    return found


def test_no_config_key_read_with_a_default_of_its_own():
    keys = _schema_keys()
    assert {"grad_accum", "bucket_cap_mb", "reduce", "activation_checkpointing"} <= keys
    found = {str(p.relative_to(ROOT.parent)): hits for p in ROOT.rglob("*.py")
             if (hits := defaulted_reads(p.read_text(), keys))}
    assert found == {}


def test_the_defaulted_read_scan_catches_a_planted_one():
    keys = {"grad_accum", "reduce"}
    planted = "k = int(cfg.get('grad_accum') or 1)\nr = ctx.cfg.strategy.get('reduce', 'reduce_scatter')\n"
    assert sorted(defaulted_reads(planted, keys)) == ["cfg.get('grad_accum') or 1",
                                                      "ctx.cfg.strategy.get('reduce', 'reduce_scatter')"]
    assert defaulted_reads("v = summary.get('grad_accum') or 1\nw = cfg.get('other') or 2\n", keys) == []


#: Module-level containers that are not caches of answers: what they hold and why.
NOT_CACHES = {
    "zeroexp/strategies/__init__.py": {"_REGISTRY"},  # the adapters, registered by their modules' import
    "zeroexp/cell/schedule.py": {"SINGLE_MICRO_BATCH"},  # a constant table (empty today)
    "zeroexp/probes/memory.py": {"_FROZEN_TENSORS"},  # a rank's tensors frozen at start-up, once per process
    "zeroexp/cli/run.py": {"_RAN_THIS_INVOCATION"},  # the command line's own invocation
    "zeroexp/_lib/grouped_mm.py": {"_LIBRARY"},  # torch's registration of a meta kernel, kept alive
}


def module_containers(source: str) -> set[str]:
    """Names a module binds at its top level to an empty dict, set or list (a cache in waiting)."""
    empty = ("{}", "set()", "dict()", "[]", "OrderedDict()")
    out = set()
    for node in ast.parse(source).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and node.value is not None and ast.unparse(node.value) in empty:
            out.add(target.id)
    return out


def test_no_module_global_cache():
    found = {rel: names for p in ROOT.rglob("*.py")
             if (names := module_containers(p.read_text()) - NOT_CACHES.get(rel := str(p.relative_to(ROOT.parent)),
                                                                            set()))}
    assert found == {}
    assert module_containers("_SHAPES: dict[str, int] = {}\nX = 1\n_SEEN = set()\n") == {"_SHAPES", "_SEEN"}


def test_the_plan_is_the_launching_processs_and_its_failure_is_the_cells(tmp_path, monkeypatch):
    """A dry run's rank leaves its measured summary; the launching process plans it and writes summary.json
    (zeroexp.launch.epilogue). An epilogue that raises fails the cell (``error.cause: epilogue``), no summary.json."""
    import zeroexp.launch.epilogue as epilogue
    from zeroexp.launch.runner import run_cell
    from zeroexp.rank.summary import MEASURED, RANKS_DIR

    cfg = compose_config([*BASE, "strategy=zero2", "dry_run=true"])
    ok = run_cell(cfg, tmp_path / "ok")
    assert ok.status == "ok" and ok.summary["plan"]["check"] in ("PASS", "n/a")
    assert (tmp_path / "ok" / RANKS_DIR / MEASURED).exists()

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(epilogue, "finish_cell", broken)
    failed = run_cell(cfg, tmp_path / "failed")
    assert failed.status == "failed" and failed.error["cause"] == "epilogue" and "planted" in failed.error["message"]
    assert not (tmp_path / "failed" / "summary.json").exists()
