"""The house's layers, as folders, read from the source's imports, function-level ones included.

What may import what: docs/architecture.md. The rules: no import circle inside zeroexp; every package of zeroexp sits
in one layer of :data:`LAYERS` and no import runs up a layer; the formulas import nothing of zeroexp; strategies import
neither probes nor config; probes import no strategy and no report; the planner imports no strategy; the rank never
imports launch; nothing imports cli but the entry points (``__main__`` modules) and cli itself; errors live in one
leaf module; at most 6 modules at the root of zeroexp/; one device rule, one class importer, one bucket cutter, one
dtype map; no source file over 500 lines. Each import rule is also run once on a planted violation, which it catches.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "zeroexp"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {_module(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str) -> set[str]:
    """The zeroexp modules ``name`` imports anywhere in its file (``from pkg import sub`` counts as ``pkg.sub``)."""
    path = SOURCES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("zeroexp")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if not base.startswith("zeroexp"):
                continue
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in SOURCES}
            out |= subs or {base}
            if len(subs) < len(node.names):
                out.add(base)
    return {m for m in out if m != name}


GRAPH = {name: _imports(name) for name in SOURCES}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_no_import_circle():
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in SOURCES:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in SOURCES:
        if v not in index:
            visit(v)
    assert circles == []


#: The layers, lowest first: a module imports from its own layer or one below it, never above. A layer is the
#: packages (or root modules) named in its tuple; ``__main__`` modules are entry points above every layer.
LAYERS = [
    ("formulas",),                                   # pure closed forms and the plain data of groups
    ("errors", "tolerances", "devices", "hostload"),  # the root's leaf modules
    ("_lib",),                                       # shims over torch's and Lightning's own machinery
    ("results",),                                    # the files a cell and a sweep leave, table parts
    ("models",),                                     # the models, their schemas, the LightningModule
    ("cell",),                                       # the validated cell: its policies, schedule, identity, Cell
    ("plan",),                                       # the planner and a cell's expectation (plan.expect)
    ("strategies",),                                 # the adapters and zeroexp's own ZeRO
    ("config",),                                     # composition and checks before launch
    ("probes",),                                     # one measurement each
    ("report",),                                     # a sweep's report
    ("rank",),                                       # one rank of a cell, a dry run
    ("launch",),                                     # the launching process: runner, launchers, preloads
    ("calibrate",),                                  # one calibration (its ranks, the file)
    ("recommend",),                                  # which configuration to run: a search over the planner
    ("cli", "checkpoint", "explain"),                # the command lines (zeroexp.checkpoint, .explain: their entries)
]
ROOT_MODULES_AT_MOST = 6


def _layer(name: str) -> int | None:
    """The index in LAYERS of module ``name``; None for an entry point (``__main__``) or the package itself."""
    parts = name.split(".")
    if len(parts) < 2 or parts[-1] == "__main__":
        return None
    return next((i for i, names in enumerate(LAYERS) if parts[1] in names), -1)


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import of ``graph`` that runs up a layer (or touches a module of no layer)."""
    bad = []
    for m, imports in graph.items():
        for i in imports:
            lm, li = _layer(m), _layer(i)
            if lm == -1 or li == -1 or (lm is not None and li is not None and li > lm):
                bad.append((m, i))
    return sorted(bad)


def test_no_import_runs_up_a_layer():
    assert _upward(GRAPH) == []
    planted = {**GRAPH, "zeroexp.formulas.paper": GRAPH["zeroexp.formulas.paper"] | {"zeroexp.rank.worker"}}
    assert _upward(planted) == [("zeroexp.formulas.paper", "zeroexp.rank.worker")]
    assert _upward({"zeroexp.unplaced": {"zeroexp.errors"}}) == [("zeroexp.unplaced", "zeroexp.errors")]


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    leaves = {p.stem for p in ROOT.glob("*.py")} - {"__init__", "__main__"}
    placed = {n for names in LAYERS for n in names}
    assert packages | leaves == placed


def test_at_most_six_modules_at_the_root():
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root) <= ROOT_MODULES_AT_MOST, root


def _bad(graph: dict[str, set[str]], layer: str, forbidden: str) -> list[tuple[str, str]]:
    return sorted((m, i) for m in graph if _within(m, layer) for i in graph[m]
                  if _within(i, forbidden) and not _within(i, layer))


RULES = [
    ("zeroexp.formulas", "zeroexp"),  # nothing outside zeroexp.formulas itself
    ("zeroexp.strategies", "zeroexp.probes"), ("zeroexp.strategies", "zeroexp.config"),
    ("zeroexp.probes", "zeroexp.strategies"), ("zeroexp.probes", "zeroexp.report"),
    ("zeroexp.plan", "zeroexp.strategies"),
    ("zeroexp.rank", "zeroexp.launch"),
    ("zeroexp.errors", "zeroexp"),
]


@pytest.mark.parametrize("layer, forbidden", RULES)
def test_layer_does_not_import(layer, forbidden):
    assert _bad(GRAPH, layer, forbidden) == []
    inside = next(m for m in sorted(GRAPH) if _within(m, layer))
    target = next(m for m in sorted(GRAPH) if _within(m, forbidden) and not _within(m, layer))
    assert _bad({**GRAPH, inside: GRAPH[inside] | {target}}, layer, forbidden) == [(inside, target)]  # a planted one


def _cli_importers(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of zeroexp.cli from anywhere but cli itself and the entry points (``__main__`` modules)."""
    return sorted((m, i) for m in graph for i in graph[m]
                  if _within(i, "zeroexp.cli") and not _within(m, "zeroexp.cli") and not m.endswith("__main__"))


def test_nothing_imports_cli_but_the_entry_points():
    assert _cli_importers(GRAPH) == []
    assert {m for m in GRAPH if m.endswith("__main__")} >= {"zeroexp.__main__", "zeroexp.plan.__main__",
                                                             "zeroexp.calibrate.__main__"}
    planted = {**GRAPH, "zeroexp.plan.core": GRAPH["zeroexp.plan.core"] | {"zeroexp.cli.plan"}}
    assert _cli_importers(planted) == [("zeroexp.plan.core", "zeroexp.cli.plan")]


def _calls(pattern: str) -> set[str]:
    return {name for name, path in SOURCES.items() if re.search(pattern, path.read_text())}


def test_one_rule_one_place():
    assert _calls(r"cuda\.device_count\(") == {"zeroexp.devices"}  # the device rule
    assert _calls(r"importlib\.import_module\(") == {"zeroexp.models.build", "zeroexp.plan", "zeroexp.strategies"}
    assert _calls(r"\bdef cut_buckets\b|\bdef \w*bucket\w*assign") == {"zeroexp.formulas.layout"}  # the bucket cutter
    assert _calls(r'"bfloat16":') == {"zeroexp.formulas.paper"}  # the dtype map (torch's own names)
    assert _calls(r"class ConfigError\b") == {"zeroexp.errors"}


def test_no_source_file_over_500_lines():
    long = {name: n for name, path in SOURCES.items() if (n := len(path.read_text().splitlines())) > 500}
    assert long == {}


def test_the_schedule_reads_each_registered_probes_own_steps():
    """zeroexp.cell.schedule.PROBE_STEPS declares the steps of the registered probes (so the launching process
    validates a
    schedule without importing them): each registered probe that needs steps takes exactly its entry, in order."""
    from zeroexp.probes import registry
    from zeroexp.cell.schedule import PROBE_STEPS

    needing = [p for p in registry() if p.steps is not None]
    assert [p.name for p in needing] == list(PROBE_STEPS)
    assert all(p.steps is PROBE_STEPS[p.name] for p in needing)


def test_the_launching_process_validates_a_cell_without_lightning():
    """``python -m zeroexp`` composes and validates the cell (its schedule included) and launches its ranks (the
    runner, the launcher, the rank entry by name, the fault switch) beside the forkserver that imports Lightning for
    the ranks, and after the run prints the digest and writes a sweep's report from every probe's line and table:
    this process imports Lightning for none of it (the probes are Lightning callbacks in the ranks only:
    ``zeroexp.probes.as_callback``)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from hydra import compose, initialize_config_dir\n"
            "from zeroexp.cli.run import CONF_DIR, register\n"
            "from zeroexp.config.schemas import validate\n"
            "from zeroexp.launch.local import launch_local, local_rank_entry\n"
            "from zeroexp.launch.runner import run_cell\n"
            "from zeroexp.rank.faults import ENV\n"
            "register()\n"
            "with initialize_config_dir(config_dir=CONF_DIR, version_base='1.3'):\n"
            "    validate(compose(config_name='config', overrides=['logger=none', 'strategy=fsdp_full']))\n"
            "from zeroexp.report import write_report\n"
            "from zeroexp.report.digest import digest\n"
            "from zeroexp.report.tables import sections\n"
            "digest({})\n"
            "assert len([(s.digest_line, s.report_table) for s in sections(report=True)]) > 7\n"
            "print(sorted(m for m in ('lightning', 'lightning.pytorch', 'torchmetrics') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_a_probe_is_a_lightning_callback_only_in_a_rank():
    """``Probe`` imports no Lightning; ``as_callback(cls)`` (made once per class) is the Lightning callback a rank runs:
    an instance of the probe class too, Lightning's no-op hooks where the probe defines none, its state key the
    probe's, and it pickles and copies as itself."""
    import copy
    import pickle

    import lightning.pytorch as pl

    from zeroexp.probes import Probe, as_callback, registry

    for cls in registry():
        assert not issubclass(cls, pl.Callback) and issubclass(cls, Probe)
        made = as_callback(cls)
        assert made is as_callback(cls) and issubclass(made, (cls, pl.Callback))
        assert made.__qualname__ == cls.__qualname__
        probe = made.__new__(made)
        probe.__dict__.update(records=[1, 2])
        assert probe.state_key == cls.__qualname__
        for hook in ("setup", "on_train_batch_start", "on_before_backward", "on_before_optimizer_step",
                     "on_train_batch_end", "on_train_end", "on_exception"):
            assert callable(getattr(probe, hook))  # the probe's own or Lightning's no-op
        for again in (pickle.loads(pickle.dumps(probe)), copy.deepcopy(probe)):
            assert type(again) is made and again.records == [1, 2]
