"""report.html in a real browser: the system's Chromium, headless, at a 1400-pixel-wide window.

What can fail and is asserted: every embedded plot decodes at the size its PNG declares; no table or image
overflows the page, no table's box scrolls sideways and every check column's cells lie in view, at the tables'
own font size; the verdicts, what won and the tables' figures read back from the DOM equal those built from the
cells' summaries; every link to a cell's files resolves; a failed cell is shown with its error. Two small sweeps
the suite shares serve the tests: ddp ok and zro failing on purpose (conftest.failed_sweep), and the ZeRO ladder at
N=2 (conftest.ladder_sweep, six cells, the wider tables); the screenshots are kept under pytest's tmp dir.
Chromium: the Debian package ``chromium`` (``make test`` installs it when missing); without it the tests skip.
"""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
import struct
import subprocess
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from zeroexp.report import build_report
from zeroexp.results.files import read_json

WIDTH = 1400
#: The tables' font size (report.html: 14 px x 0.9): they fit by layout, not by a smaller font.
TABLE_FONT_PX = 12.6
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: `apt-get install chromium` (make test does "
                                                          "it as root) to run the browser test of report.html"),
              # slow by hand: its pages come through request.getfixturevalue (any_page), which conftest's reading of
              # the tests' fixtures cannot follow to the session sweeps and Chromium they start
              pytest.mark.slow]

# Run in the page once it has loaded: what the browser laid out and decoded, written into the DOM for --dump-dom.
MEASURE = """<script>
window.addEventListener('load', () => {
  const box = e => { const r = e.getBoundingClientRect(); return {left: r.left, right: r.right, width: r.width}; };
  const text = e => e.textContent;
  const out = {
    viewport: document.documentElement.clientWidth, scrollWidth: document.documentElement.scrollWidth,
    images: [...document.images].map(i => ({alt: i.alt, complete: i.complete, w: i.naturalWidth,
                                             h: i.naturalHeight, box: box(i)})),
    tables: [...document.querySelectorAll('table')].map(t => ({
      key: (t.closest('div').previousElementSibling || {}).id, box: box(t),
      scroll: {scrollWidth: t.parentElement.scrollWidth, clientWidth: t.parentElement.clientWidth},
      container: box(t.parentElement),
      font: [...t.querySelectorAll('th, td')].map(c => parseFloat(getComputedStyle(c).fontSize)),
      head: [...t.querySelectorAll('thead th')].map(text),
      checks: [...t.querySelectorAll('thead th')].map((th, i) => [th, i])
        .filter(([th]) => /check$/.test(th.textContent))
        .map(([th, i]) => ({header: th.textContent,
                            boxes: [th, ...[...t.querySelectorAll('tbody tr')].map(r => r.cells[i])].map(box)})),
      rows: [...t.querySelectorAll('tbody tr')].map(r => [...r.cells].map(text))})),
    verdicts: [...document.querySelectorAll('.verdicts > ul:not(.failures) > li')].map(text),
    winners: [...document.querySelectorAll('.winners > ul > li')].map(text),
    failures: [...document.querySelectorAll('.verdicts ul.failures li')].map(text),
    links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  };
  const pre = document.createElement('pre');
  pre.id = 'zx-measure';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def _chromium(*args: str, user_data: Path) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
           f"--user-data-dir={user_data}", f"--window-size={WIDTH},2000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _open(ran: Path, root: Path) -> dict:
    """A copy of the sweep ``ran`` under ``root``, its report opened in Chromium: the measurements, the HTML, the
    screenshot."""
    sweep_dir = root / "sweep"
    shutil.copytree(ran, sweep_dir)  # the probe page is written beside report.html: not into the shared sweep
    source = (sweep_dir / "report.html").read_text(encoding="utf-8")
    probe = sweep_dir / "report.measure.html"  # beside report.html: the same relative links
    probe.write_text(source.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    dom = _chromium("--virtual-time-budget=10000", "--dump-dom", probe.as_uri(), user_data=root / "profile")
    found = re.search(r'<pre id="zx-measure">(.*?)</pre>', dom.stdout, re.S)
    assert found, f"no measurements in the dumped DOM (rc {dom.returncode}): {dom.stderr[-2000:]}"
    shot = root / "report.png"
    snap = _chromium(f"--screenshot={shot}", (sweep_dir / "report.html").as_uri(), user_data=root / "profile")
    assert shot.exists() and shot.stat().st_size > 0, snap.stderr[-2000:]
    print(f"screenshot of report.html at {WIDTH} px: {shot}")
    return {"sweep": sweep_dir, "m": json.loads(html.unescape(found[1])), "html": source, "shot": shot}


@pytest.fixture(scope="module")
def page(failed_sweep, tmp_path_factory) -> dict:
    """The failing-cell sweep (conftest.failed_sweep, a copy of it) in Chromium."""
    ran, proc = failed_sweep
    assert proc.returncode == 1 and (ran / "report.html").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return _open(ran, tmp_path_factory.mktemp("browser"))


@pytest.fixture(scope="module")
def ladder_page(ladder_sweep, tmp_path_factory) -> dict:
    """The ladder sweep (conftest.ladder_sweep, a copy of it) in Chromium: six cells, every table filled."""
    ran, proc = ladder_sweep
    assert proc.returncode == 0 and (ran / "report.html").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return _open(ran, tmp_path_factory.mktemp("browser_ladder"))


@pytest.fixture(params=["page", "ladder_page"])
def any_page(request) -> dict:
    return request.getfixturevalue(request.param)


def test_screenshot_is_kept(any_page):
    assert _png_size(any_page["shot"].read_bytes())[0] == WIDTH


def test_every_plot_decodes_at_its_declared_size(any_page):
    declared = [_png_size(base64.b64decode(b64)) for b64 in
                re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', any_page["html"])]
    images = any_page["m"]["images"]
    assert declared and len(images) == len(declared)
    for img, (w, h) in zip(images, declared):
        assert img["complete"] and (img["w"], img["h"]) == (w, h), img


def test_nothing_overflows_a_1400_pixel_page(any_page):
    m = any_page["m"]
    assert m["viewport"] == WIDTH and m["scrollWidth"] <= WIDTH, (m["viewport"], m["scrollWidth"])
    for kind in ("images", "tables"):
        for item in m[kind]:
            assert 0 <= item["box"]["left"] and item["box"]["right"] <= WIDTH, (kind, item.get("key"), item["box"])


def test_every_table_fits_with_its_check_column_in_view(any_page):
    """No table scrolls sideways at 1400 px, each check column's header and cells lie inside the table's box and
    the window, and the tables keep their font size (they fit by wrapping headers and long texts)."""
    tables = any_page["m"]["tables"]
    for t in tables:
        assert t["scroll"]["scrollWidth"] <= t["scroll"]["clientWidth"], (t["key"], t["scroll"], t["head"])
        assert min(t["font"]) >= TABLE_FONT_PX - 0.01, (t["key"], min(t["font"]))
        for column in t["checks"]:
            for cell in column["boxes"]:
                assert t["container"]["left"] <= cell["left"] and cell["right"] <= t["container"]["right"], \
                    (t["key"], column["header"], cell, t["container"])
                assert 0 <= cell["left"] and cell["right"] <= WIDTH and cell["width"] > 0, (t["key"], cell)
    checked = {t["key"] for t in tables if any(c["header"] == "check" for c in t["checks"])}
    assert {"state", "collectives", "equivalence", "plan"} <= checked, checked


def test_what_won_reads_back_from_the_page(ladder_page, page):
    for p in (ladder_page, page):
        assert p["m"]["winners"] == build_report(p["sweep"]).winners.lines
    assert page["m"]["winners"][-1] == "Not competing (only cells whose checks passed do): zro (cell failed)."


def test_verdicts_and_figures_equal_the_summaries(page):
    m, sweep_dir = page["m"], page["sweep"]
    report = build_report(sweep_dir)
    assert m["verdicts"] == report.verdicts.lines and m["failures"] == report.verdicts.failures
    ok = [read_json(p.with_name("summary.json")) for p in sweep_dir.glob("*/manifest.json")
          if read_json(p)["status"] == "ok"]
    assert len(ok) == 1
    for section in ("state", "collectives", "equivalence"):
        passed = sum(s[section]["check"] == "PASS" for s in ok)
        assert any(v.startswith(f"{section}: {passed} of 1 finished cells PASS") for v in m["verdicts"]), m["verdicts"]
    shown = {t["key"]: t for t in m["tables"]}
    for table in report.tables:
        frame = table.display()
        if frame.empty:
            continue
        assert shown[table.key]["head"] == list(frame.columns), table.key
        assert shown[table.key]["rows"] == [[str(v) for v in row] for row in frame.itertuples(index=False)], table.key
    cells = dict(zip(shown["cells"]["head"], shown["cells"]["rows"][0]))
    assert cells["final loss"] == f"{ok[0]['final_loss']:.6g}"


def test_links_to_cell_files_resolve(page):
    links = page["m"]["links"]
    cells = {p.parent.name for p in page["sweep"].glob("*/manifest.json")}
    assert len(links) >= len(cells) + 1  # each cell's directory, and the failed cell's log
    linked = set()
    for href in links:
        url = urlparse(href)
        path = Path(unquote(url.path))
        assert url.scheme == "file" and path.is_file(), href
        assert path.resolve().is_relative_to(page["sweep"].resolve()), href
        linked.add(path.relative_to(page["sweep"]).parts[0])
    assert linked == cells


def test_the_failed_cell_is_shown(page):
    m = page["m"]
    assert any(f.startswith("zro: cell failed: rank 0 (exception)") and "injected fault" in f for f in m["failures"])
    failures = {t["key"]: t for t in m["tables"]}["failures"]
    row = dict(zip(failures["head"], failures["rows"][0]))
    assert len(failures["rows"]) == 1 and row["cell"] == "zro" and row["status"] == "failed"
    assert "injected fault" in row["error"]


# The plan's picture (python -m zeroexp.plan format=html, zeroexp.report.plan_picture), laid out by the browser.
PICTURE_MEASURE = """<script>
window.addEventListener('load', () => {
  const box = e => { const r = e.getBoundingClientRect(); return {left: r.left, right: r.right, width: r.width}; };
  const out = {viewport: document.documentElement.clientWidth, scrollWidth: document.documentElement.scrollWidth,
    bars: [...document.querySelectorAll('svg.bar')].map(s => ({
      row: s.closest('section').dataset.key, box: box(s),
      segs: [...s.querySelectorAll('rect.seg')].map(r => ({kind: r.dataset.bar, field: r.dataset.field,
        value: parseFloat(r.dataset.bytes || r.dataset.ms), tip: r.querySelector('title').textContent, box: box(r)})),
      lines: [...s.querySelectorAll('line.limit')].map(l => ({field: l.dataset.field,
        value: parseFloat(l.dataset.bytes), x: l.getBoundingClientRect().left}))}))};
  const pre = document.createElement('pre');
  pre.id = 'zx-measure';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


@pytest.fixture(scope="module")
def plan_picture(tmp_path_factory) -> tuple[list[dict], dict]:
    """The tiny GPT's plan on 8 H100s (tests/test_plan_picture.py's) drawn, opened in Chromium: records, layout."""
    from test_plan_picture import GPU_PLAN, _compose

    from zeroexp.cli.plan import run
    from zeroexp.report.plan_picture import plan_page

    records, notes = run(_compose("plan", *GPU_PLAN))
    root = tmp_path_factory.mktemp("browser_plan")
    page = root / "plan.html"
    page.write_text(plan_page(records, notes).replace("</body>", PICTURE_MEASURE + "</body>"), encoding="utf-8")
    dom = _chromium("--virtual-time-budget=10000", "--dump-dom", page.as_uri(), user_data=root / "profile")
    found = re.search(r'<pre id="zx-measure">(.*?)</pre>', dom.stdout, re.S)
    assert found, f"no measurements in the dumped DOM (rc {dom.returncode}): {dom.stderr[-2000:]}"
    return records, json.loads(html.unescape(found[1]))


def test_the_plan_picture_draws_each_field_to_one_scale_in_a_1400_pixel_page(plan_picture):
    """Every row's two bars lie in the page; each segment's drawn width is its record field to the bar kind's one
    scale (within a pixel), the segments abut, each has its tooltip naming the field; the usable and device lines
    stand at their fields' values on the memory scale."""
    records, m = plan_picture
    assert m["viewport"] == WIDTH and m["scrollWidth"] <= WIDTH, (m["viewport"], m["scrollWidth"])
    by_key = {f"{r['strategy']}@{r['world_size']}": r for r in records}
    assert {b["row"] for b in m["bars"]} == set(by_key) and len(m["bars"]) == 2 * len(records)
    for kind in ("memory", "step"):
        segs = [s for b in m["bars"] for s in b["segs"] if s["kind"] == kind]
        scale = sum(s["box"]["width"] for s in segs) / sum(s["value"] for s in segs)  # px per byte, per ms
        for s in segs:
            assert abs(s["box"]["width"] - scale * s["value"]) <= 1, (kind, s)
            assert s["tip"].startswith(f"{s['tip'].split(':')[0]}: {s['field']} = "), s["tip"]
        if kind == "memory":
            for b in m["bars"]:
                origin = b["segs"][0]["box"]["left"] if b["segs"] else None
                for line in b["lines"]:
                    assert line["value"] == by_key[b["row"]][line["field"]]
                    assert abs(line["x"] - origin - scale * line["value"]) <= 1.5, (b["row"], line)
    for b in m["bars"]:
        assert 0 <= b["box"]["left"] and b["box"]["right"] <= WIDTH, b["box"]
        for a, c in zip(b["segs"], b["segs"][1:]):
            assert abs(a["box"]["right"] - c["box"]["left"]) <= 0.5, (b["row"], a["field"], c["field"])
