"""The README's command-line block runs as written (issue 18), and
docs/first-run.md (written by docs/transcript.py) is the transcript of exactly
those commands. In-process through typer's runner, one after the other in one
directory, as the transcript runs them."""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import transcript  # noqa: E402

from autopar.cli import app  # noqa: E402


def test_the_transcript_is_of_the_readme_commands():
    shown = re.findall(r"^## `(autopar .*)`$", (ROOT / "docs" / "first-run.md").read_text(), flags=re.M)
    assert shown == transcript.readme_commands(), \
        "docs/first-run.md is out of date: run .venv/bin/python docs/transcript.py"


def test_every_readme_command_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for name, (how, what) in transcript.SETUP.items():
        if how == "text":
            Path(name).write_text(what)
        else:
            assert runner.invoke(app, what).exit_code == 0, name
    failed = []
    for cmd in transcript.readme_commands():
        res = runner.invoke(app, shlex.split(cmd)[1:])
        if res.exit_code != transcript.expected_exit(cmd):
            failed.append(f"{cmd}: exit {res.exit_code}\n{res.output[-1500:]}")
    assert not failed, "\n\n".join(failed)
    assert Path("plan.json").exists() and Path("report.html").exists()


@pytest.mark.parametrize("text,want", [
    ("## Command line\n\n```\nautopar zoo   # x\nautopar plan a \\\n    --b 1\nnot this\n```\n",
     ["autopar zoo", "autopar plan a --b 1"]),
])
def test_commands_are_read_from_the_block(text, want):
    assert transcript.readme_commands(text) == want
