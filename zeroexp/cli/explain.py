"""``python -m zeroexp.explain CELL [format=table|json]``: one finished cell's checks and where a FAIL came from;
``python -m zeroexp.explain A B [format=table|json]``: two finished cells side by side.

One cell (zeroexp.report.explain_cell): every check with its verdict and reasons, the failed first, and the
equivalence's divergence as the cell recorded it (the first step, tensor, kind and cause where training parted from the
reference: zeroexp.probes.divergence), or, for a FAIL the cell did not replay, the command that replays it.

Two cells:
What differs between the two cells' configurations (``manifest.json``: the composed configuration, where each wrote
left out), their checks (each verdict in each), and every figure both measured (``summary.json``: state bytes by kind,
steady, peak and phase peaks, collective calls, payload and bus bytes by op, exposed communication, step time, the
equivalence error, the final loss, a checkpoint's bytes and times), the largest difference first (by the ratio of
the two; a figure one cell lacks or has at zero first of all). Measured figures only: nothing is run or predicted
(zeroexp.report.compare).

Exit 0 explained or compared; 2 refused before reading anything else (the argument named): not one or two
directories, one that is no cell directory or whose cell wrote no summary, an unknown ``format``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from zeroexp.cli.plain_args import args_or_help
from zeroexp.errors import ConfigError

__all__ = ["main", "USAGE"]

USAGE = ("usage: python -m zeroexp.explain CELL [format=table|json]   (one cell: its checks, where a FAIL came from)\n"
         "       python -m zeroexp.explain A B [format=table|json]  (two cells side by side)")
FORMATS = ("table", "json")


def _args(args: list[str]) -> tuple[list[str], str]:
    """The two directories and the format; ConfigError naming the argument otherwise."""
    fmt, dirs = "table", []
    for a in args:
        if a.startswith("format="):
            fmt = a.partition("=")[2]
            if fmt not in FORMATS:
                raise ConfigError("format", fmt, ", ".join(FORMATS))
        elif "=" in a:
            raise ConfigError(a.partition("=")[0], a.partition("=")[2], "format=table|json", why="the one key")
        else:
            dirs.append(a)
    if len(dirs) not in (1, 2):
        raise ConfigError("CELL", " ".join(dirs) or None, "one or two cell directories", why=f"{len(dirs)} given")
    return dirs, fmt


def _shown(value: Any, unit: str) -> str:
    from zeroexp.results.format import byte_unit, fmt_err, fmt_number

    if value is None:
        return "-"
    if unit == "B":
        u = byte_unit([value])
        return f"{u(value)} {u.name}"
    if unit == "":
        return fmt_err(value) if abs(value) < 1e-2 else fmt_number(value)
    return f"{fmt_number(value)} {unit}"


def _print(diff: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    console.print(f"A: {diff['a']['cell']} ({diff['a']['dir']})\nB: {diff['b']['cell']} ({diff['b']['dir']})\n")
    table = Table(title=f"Configuration: {len(diff['config'])} keys differ")
    for c in ("key", "A", "B"):
        table.add_column(c)
    for row in diff["config"]:
        table.add_row(row["key"], str(row["a"]), str(row["b"]))
    console.print(table)
    table = Table(title="Checks (those that differ first)")
    for c in ("check", "A", "B"):
        table.add_column(c)
    for row in diff["checks"]:
        table.add_row(row["check"], row["a"], row["b"], style=None if row["a"] == row["b"] else "bold")
    console.print(table)
    table = Table(title=f"Measured figures that differ, largest difference first ({diff['same']} equal, not shown)")
    for i, c in enumerate(("figure", "of", "A", "B", "B / A")):
        table.add_column(c, justify="right" if i > 1 else "left")
    for row in diff["figures"]:
        table.add_row(row["figure"], row["of"], _shown(row["a"], row["unit"]), _shown(row["b"], row["unit"]),
                      "-" if row["ratio"] is None else f"{row['ratio']:.3g}")
    console.print(table)
    for note in diff["notes"]:
        console.print(f"note: {note}")


def _print_one(told: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from zeroexp.probes.divergence import divergence_line

    console = Console(soft_wrap=True)
    console.print(f"{told['cell']} ({told['dir']}): {told['failed']} check(s) FAILed or ERRORed\n")
    table = Table(title="Checks (failed first)")
    for c in ("check", "verdict", "why"):
        table.add_column(c)
    for row in told["checks"]:
        table.add_row(row["check"], row["verdict"], "; ".join(row["reasons"]) or "-",
                      style="bold" if row["verdict"] in ("FAIL", "ERROR") else None)
    console.print(table)
    peak = told["memory_at_peak"]
    if peak is not None:
        table = Table(title=f"What the step made alive at rank {peak['rank']}'s peak ({peak['phase']}, "
                            f"{peak['bytes']} B), by module and by op")
        for c in ("module", "bytes", "op", "bytes "):
            table.add_column(c, justify="right" if c.startswith("bytes") else "left")
        mods, ops = list(peak["by_module"].items()), list(peak["by_op"].items())
        for i in range(max(len(mods), len(ops))):
            m, o = (mods[i] if i < len(mods) else ("", "")), (ops[i] if i < len(ops) else ("", ""))
            table.add_row(m[0], str(m[1]), o[0], str(o[1]))
        console.print(table)
    eq = told["equivalence"]
    if eq["divergence"] is not None:
        console.print(f"equivalence ({eq['check']}): {divergence_line(eq['divergence'])}")
    if eq["replay"]:
        console.print(f"equivalence FAIL, not located (the cell did not replay its steps, or the replay raised); "
                      f"replay it:\n  {eq['replay']}")


def main(argv: list[str] | None = None) -> None:
    """The command line (module docstring)."""
    from zeroexp.report.compare import compare, read_cell

    args = args_or_help(argv, __doc__, USAGE)
    try:
        dirs, fmt = _args(args)
        cells = []
        for key, where in zip(("A", "B") if len(dirs) == 2 else ("CELL",), dirs):
            try:
                cells.append(read_cell(where))
            except ValueError as e:
                raise ConfigError(key, where, "a cell directory with its summary.json", why=str(e)) from None
    except ConfigError as e:
        print(f"{e}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2) from None
    if len(cells) == 1:
        from zeroexp.report.explain_cell import explain_cell

        told = explain_cell(cells[0])
        print(json.dumps(told, indent=1, default=str)) if fmt == "json" else _print_one(told)
        return
    diff = compare(*cells)
    if fmt == "json":
        print(json.dumps(diff, indent=1, default=str))
    else:
        _print(diff)
