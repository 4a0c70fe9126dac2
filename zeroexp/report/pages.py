"""Markdown and self-contained HTML from one :class:`~zeroexp.report.Report` (same tables, same strings).

The HTML embeds its plots as base64 PNG and its style inline: it opens offline and references nothing.
"""

from __future__ import annotations

import base64
import html
from typing import TYPE_CHECKING
from urllib.parse import quote

from zeroexp.results.format import NA
from zeroexp.results.verdict import Verdict

if TYPE_CHECKING:
    from zeroexp.report.model import Report
    from zeroexp.results.section import ReportTable

__all__ = ["to_markdown", "to_html", "CSS"]


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _md_table(table: ReportTable) -> list[str]:
    shown = table.display()
    if shown.empty:
        return [f"_{table.empty_text}_"]
    lines = ["| " + " | ".join(_md_cell(c) for c in shown.columns) + " |",
             "|" + "|".join("---" for _ in shown.columns) + "|"]
    lines += ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in shown.itertuples(index=False)]
    return lines


def winners_markdown(report: Report) -> list[str]:
    """The what-won lines as Markdown bullets, then their note (``report.md`` and the W&B Report)."""
    w = report.winners
    return [f"- {line}" for line in w.lines] + (["", w.note] if w.note else [])


def to_markdown(report: Report) -> str:
    """``report.md``: verdicts, what won, then each table with its note and its plot (the PNG files beside it)."""
    out = [f"# zeroexp sweep report: {report.sweep_dir.name}", "",
           f"{report.sweep_dir} · generated {report.generated_at} · {report.environment}", "", "## Verdicts", ""]
    out += [f"- {line}" for line in report.verdicts.lines]
    failures = report.verdicts.failures
    out += ["", "**Failures:**", "", *(f"- {f}" for f in failures)] if failures else ["", "**Failures:** none."]
    out += ["", "## What won", "", *winners_markdown(report)]
    for table in report.tables:
        out += ["", f"## {table.title}", "", *_md_table(table)]
        if table.note:
            out += ["", table.note]
        out += ["", *(f"- {b}" for b in table.bullets)] if table.bullets else []
        out += [line for name, caption, key in report.plots if key == table.key
                for line in ("", f"![{caption}]({name})")]
    return "\n".join(out).rstrip() + "\n"


#: Tables fit the page's 1200 px column (tests/test_report_browser.py measures it at a 1400 px window): headers
#: wrap at their spaces, long or spaced texts wrap and a cell's directory anywhere; numbers and verdicts stay whole.
CSS = """
body{font:14px/1.45 -apple-system,'Segoe UI',Helvetica,Arial,sans-serif;color:#1f2328;max-width:1200px;\
margin:2em auto;padding:0 1.5em}
h1{font-size:1.6em;border-bottom:1px solid #d0d7de;padding-bottom:.3em}h2{font-size:1.25em;margin-top:1.8em}
.meta{color:#59636e;font-size:.9em}.note{color:#59636e;font-size:.88em;max-width:60em}
.verdicts,.winners{border:1px solid #d0d7de;border-left:6px solid #1a7f37;border-radius:6px;padding:.6em 1.2em;\
background:#f6f8fa}.winners{border-left-color:#0969da;margin-top:1em}
.verdicts.bad{border-left-color:#cf222e}.verdicts h2,.winners h2{margin-top:.3em}
.verdicts li,.winners li{margin:.15em 0}
.failures li{color:#cf222e}
.scroll{overflow-x:auto}table{border-collapse:collapse;font-size:.9em;margin:.4em 0}
th,td{border:1px solid #d0d7de;padding:.3em .6em;white-space:nowrap}th{background:#f6f8fa;text-align:left;\
white-space:normal;vertical-align:bottom}
td.num{text-align:right;font-variant-numeric:tabular-nums}tr:nth-child(even) td{background:#fbfcfd}
td.pass{color:#1a7f37;font-weight:600}td.fail{color:#cf222e;font-weight:600}td.warn{color:#9a6700}
td.soft{white-space:normal}td.path{white-space:normal;overflow-wrap:anywhere;min-width:8em}\
td.wrap{white-space:normal;min-width:16em}figure{margin:1.2em 0}
img{max-width:100%;border:1px solid #d0d7de}figcaption{color:#59636e;font-size:.9em}
"""


def _td(text: str) -> str:
    cls = {Verdict.PASS: "pass", Verdict.FAIL: "fail", Verdict.ERROR: "fail", "failed": "fail", "unstable": "warn",
           "ok": "pass"}.get(text, "")
    stripped = text.replace(",", "").replace("×", "").replace(" %", "").split(" (exp.")[0]
    try:
        float(stripped)
        cls = cls or "num"
    except ValueError:
        cls = cls or ("wrap" if len(text) > 60 else "soft" if " " in text and len(text) > 12 else "")
    return f'<td class="{cls}">{html.escape(text)}</td>' if cls else f"<td>{html.escape(text)}</td>"


def _linked_row(columns: list[str], row: tuple) -> str:
    """A row's cells; a cell's ``directory`` links to its ``manifest.json`` and its ``log`` to the log file
    (relative to the sweep directory, where report.html lies)."""
    values = dict(zip(columns, map(str, row)))
    cell = values.get("directory", "")
    out = []
    for col, text in values.items():
        target = {"directory": "manifest.json", "log": text}.get(col) if cell and cell != NA else None
        if target and text and text != NA:
            href = html.escape(quote(f"{cell}/{target}"))
            out.append(f'<td class="path"><a href="{href}">{html.escape(text)}</a></td>')
        else:
            out.append(_td(text))
    return "<tr>" + "".join(out) + "</tr>"


def _html_table(table: ReportTable) -> str:
    shown = table.display()
    if shown.empty:
        return f'<p class="note"><em>{html.escape(table.empty_text)}</em></p>'
    head = "".join(f"<th>{html.escape(c)}</th>" for c in shown.columns)
    rows = "".join(_linked_row(list(shown.columns), row) for row in shown.itertuples(index=False))
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>'


def to_html(report: Report) -> str:
    """``report.html``: the same content as the Markdown, with the plots embedded as base64 PNG."""
    esc = html.escape
    v = report.verdicts
    parts = [f"<h1>zeroexp sweep report: {esc(report.sweep_dir.name)}</h1>",
             f'<p class="meta">{esc(str(report.sweep_dir))} · generated {esc(report.generated_at)} · '
             f"{esc(report.environment)}</p>",
             f'<div class="verdicts{"" if v.ok else " bad"}"><h2>Verdicts</h2><ul>'
             + "".join(f"<li>{esc(line)}</li>" for line in v.lines) + "</ul>"
             + ('<p><strong>Failures:</strong></p><ul class="failures">'
                + "".join(f"<li>{esc(f)}</li>" for f in v.failures) + "</ul>" if v.failures
                else "<p><strong>Failures:</strong> none.</p>") + "</div>",
             '<div class="winners" id="winners"><h2>What won</h2><ul>'
             + "".join(f"<li>{esc(line)}</li>" for line in report.winners.lines) + "</ul>"
             + (f'<p class="note">{esc(report.winners.note)}</p>' if report.winners.note else "") + "</div>"]
    for table in report.tables:
        parts += [f'<h2 id="{table.key}">{esc(table.title)}</h2>', _html_table(table)]
        if table.note:
            parts.append(f'<p class="note">{esc(table.note)}</p>')
        if table.bullets:
            parts.append('<ul class="note">' + "".join(f"<li>{esc(b)}</li>" for b in table.bullets) + "</ul>")
        for name, caption, key in report.plots:
            if key == table.key:
                data = base64.b64encode((report.sweep_dir / name).read_bytes()).decode("ascii")
                parts.append(f'<figure><img alt="{esc(caption)}" src="data:image/png;base64,{data}">'
                             f"<figcaption>{esc(caption)} ({esc(name)})</figcaption></figure>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>zeroexp report {esc(report.sweep_dir.name)}</title><style>{CSS}</style></head><body>"
            + "\n".join(parts) + "</body></html>\n")
