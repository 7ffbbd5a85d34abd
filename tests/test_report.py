"""The HTML plan report (issue 18): `autopar show plan.json --html` and
`autopar plan ... --html` write one self-contained page, checked as HTML and,
where Debian's chromium is installed (`make test` installs it when it can),
rendered headless: the DOM has the sections and numbers, and a screenshot
shows the memory bars' and the timeline's colours."""
from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

import autopar
from autopar.cli import app
from autopar.report import BACKWARD_COLOR, FORWARD_COLOR, MEMORY_COLORS, html_report

GPT = "gpt:layers=4,hidden=32,heads=4,seq=8,vocab=64"
WHERE = ["--cluster", "cpu", "--devices", "4", "--global-batch", "8"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class _Page(HTMLParser):
    """Headings, texts and external references of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.h2: list[str] = []
        self.text: list[str] = []
        self.external: list[str] = []
        self.scripts = 0
        self._in_h2 = False

    def handle_starttag(self, tag, attrs):
        self._in_h2 = tag == "h2"
        self.scripts += tag == "script"
        for k, v in attrs:
            if k in ("src", "href") and v and not v.startswith("#"):
                self.external.append(v)

    def handle_endtag(self, tag):
        self._in_h2 = False if tag == "h2" else self._in_h2

    def handle_data(self, data):
        (self.h2 if self._in_h2 else self.text).append(data.strip())


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    return page


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    plan_path = d / "plan.json"
    res = CliRunner().invoke(app, ["plan", GPT, *WHERE, "--strategy", "pp=2,dp=2,microbatches=4", "--out",
                                   str(plan_path)])
    assert res.exit_code == 0, res.output
    shown = CliRunner().invoke(app, ["show", str(plan_path), "--html", str(d / "show.html")])
    assert shown.exit_code == 0, shown.output
    searched = CliRunner().invoke(app, ["plan", GPT, *WHERE, "--html", str(d / "auto.html")])
    assert searched.exit_code == 0, searched.output
    return d, autopar.Plan.load(plan_path)


def test_report_has_every_section_and_is_self_contained(pages):
    d, plan = pages
    text = (d / "show.html").read_text()
    page = _parse(text)
    assert page.h2 == ["Summary", "Memory per device", "Predicted pipeline timeline", "Parameter placements"]
    assert not page.external and page.scripts == 0          # nothing fetched, nothing run
    body = " ".join(page.text)
    assert plan.strategy in body and "pipeline rank 1" in body and "model.blocks.*.attn.q.weight" in body
    assert text.count('class="ev-F"') == 2 * 4 and text.count('class="ev-B"') == 2 * 4   # 2 ranks x 4 microbatches
    assert text == html_report(plan)      # the command writes what the function returns


def test_searched_report_lists_the_runners_up(pages):
    d, _ = pages
    page = _parse((d / "auto.html").read_text())
    assert page.h2[-1] == "Runners-up"
    assert any(t.startswith("+") and t.endswith("%") for t in page.text)    # how much slower each one is


def test_report_into_a_missing_directory_is_refused(pages, tmp_path):
    d, _ = pages
    res = CliRunner().invoke(app, ["show", str(d / "plan.json"), "--html", str(tmp_path / "no" / "r.html")])
    assert res.exit_code == 2 and "does not exist" in " ".join(res.output.split())


def _chromium(*args: str, user_dir: Path) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", f"--user-data-dir={user_dir}"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine: `make test` installs Debian's chromium "
                                             "where apt-get runs as root; elsewhere install it to run this test")
def test_report_renders_in_a_headless_browser(pages, tmp_path):
    import numpy as np
    from matplotlib.image import imread

    d, plan = pages
    url = (d / "show.html").resolve().as_uri()
    dom = _chromium("--dump-dom", url, user_dir=tmp_path / "u1")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Predicted pipeline timeline" in dom.stdout and plan.strategy in dom.stdout
    shot = tmp_path / "shot.png"
    res = _chromium("--window-size=1200,900", f"--screenshot={shot}", url, user_dir=tmp_path / "u2")
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    rgb = (imread(shot)[..., :3] * 255).round().astype(int).reshape(-1, 3)
    seen = {tuple(p) for p in np.unique(rgb, axis=0)}

    def shown(color: str) -> bool:
        want = tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))
        return want in seen

    missing = [k for k, c in {**MEMORY_COLORS, "forward": FORWARD_COLOR, "backward": BACKWARD_COLOR}.items()
               if not shown(c)]
    assert not missing, f"not drawn on the screenshot: {missing}"
