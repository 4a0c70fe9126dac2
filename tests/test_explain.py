"""``python -m zeroexp.explain A B`` (zeroexp.cli.explain, zeroexp.report.compare): two finished cells side by side,
on tests/test_checkpoint.py's DDP and FSDP2 cells of the mlp at N=2 (shared, not run again)."""

from __future__ import annotations

import json

import pytest

from zeroexp.cli.explain import main

P = 8 * 64 * 64 * 4  # the test mlp's fp32 parameters


def _dir(cell, strategy: str) -> str:
    result = cell(f"strategy={strategy}", "checkpoint=full", "world_size=2", "checkpoint.keep=true")
    assert result.status == "ok", result.error
    return str(result.cell_dir)


def test_two_cells_differ_where_their_strategies_do(cell, capsys):
    """DDP against FSDP2: the strategy's keys differ (those both have first); every check the same; DDP's all_reduce
    against FSDP2's all_gather and reduce_scatter first (one cell calls none of them), then the state FSDP2 halves."""
    main([_dir(cell, "ddp"), _dir(cell, "fsdp2_full"), "format=json"])
    diff = json.loads(capsys.readouterr().out)
    assert [r["key"] for r in diff["config"][:2]] == ["strategy.layout", "strategy.name"]
    assert all(r["a"] == r["b"] == "PASS" for r in diff["checks"] if r["check"] != "plan.time")
    first = {(r["figure"], r["of"]): r for r in diff["figures"][:6]}
    assert first[("collective calls per step", "all_reduce")]["b"] == 0
    assert first[("collective calls per step", "all_gather")]["a"] == 0
    optim = next(r for r in diff["figures"] if r["figure"].startswith("state bytes") and r["of"] == "optim")
    assert (optim["a"], optim["b"], optim["ratio"]) == (2 * P, P, 0.5)
    sizes = [abs(r["ratio"] - 1) if r["ratio"] else float("inf") for r in diff["figures"]]
    assert sizes[0] == float("inf") and diff["same"] > 0


def test_what_is_not_one_or_two_cells_is_refused_naming_the_argument(cell, tmp_path, capsys):
    one = _dir(cell, "ddp")
    for args, named in [([one, one, one], "CELL="), ([one, str(tmp_path)], "B="),
                        ([str(tmp_path)], "CELL="), ([one, one, "format=xml"], "format="),
                        ([one, one, "steps=3"], "steps=")]:
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2 and named in capsys.readouterr().err, args
    main([one, one])  # a cell against itself: nothing differs
    shown = capsys.readouterr().out
    assert "Configuration: 0 keys differ" in shown and "Measured figures that differ" in shown
    main([one])  # one cell: its checks, none failed, nothing to locate
    shown = capsys.readouterr().out
    assert "0 check(s) FAILed" in shown and "replay it" not in shown
