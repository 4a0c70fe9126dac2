"""The sweep report's winners line: what won on each axis, and the trade-off between them, on given cells."""

from __future__ import annotations


def test_the_reports_winners_line_names_each_axis_and_the_trade_off():
    import pandas as pd

    from zeroexp.report.verdicts import winners_line

    ok = pd.DataFrame({"label": ["ddp", "fsdp_full", "zero2"], "timing.median_ms": [10.0, 12.5, 11.0],
                       "memory.peak_bytes_max": [40e6, 20e6, 30e6],
                       "collectives.payload_total_bytes": [8e6, 12e6, 6e6]})
    assert winners_line(ok) == [
        "Winners: fastest ddp (10.0 ms median step); lowest peak fsdp_full (20.0 MB); least communication zero2 "
        "(6.00 MB sent a step). Trade-off: the fastest holds 2.00x the lowest peak, the lowest peak steps 1.25x the "
        "fastest's time."]
    one = ok.assign(**{"timing.median_ms": [9.0, 12.5, 11.0], "memory.peak_bytes_max": [10e6, 20e6, 30e6],
                       "collectives.payload_total_bytes": [1e6, 12e6, 6e6]})
    assert winners_line(one)[0].endswith(": one cell wins every axis.")
    assert winners_line(ok.iloc[:1]) == []  # one cell wins nothing


def test_dry_runs_win_nothing():
    import pandas as pd

    from zeroexp.report.verdicts import winners_line

    ok = pd.DataFrame({"label": ["ddp", "fsdp_full", "zero2"], "timing.median_ms": [10.0, 12.5, None],
                       "memory.peak_bytes_max": [40e6, 20e6, 1e6], "collectives.payload_total_bytes": [8e6, 12e6, 1e6],
                       "mode": ["train", "train", "dry_run"]})
    assert "zero2" not in winners_line(ok)[0]
