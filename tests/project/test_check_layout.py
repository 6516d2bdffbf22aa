"""docs/check_layout.py: a page with a clipped code line or a table wider than its column is
found, in a real headless browser; a page that fits passes.  Skipped where Chromium is not
installed (``apt-get install chromium``; CI installs it for the documentation's check)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.local, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_layout", ROOT / "docs" / "check_layout.py")
check_layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_layout)

PAGE = """<!DOCTYPE html><html><head><style>
article {{ width: 500px; font: 14px monospace; }} pre {{ overflow-x: auto; margin: 0; }}
</style></head><body><article role="main">{body}</article></body></html>
"""


@pytest.fixture
def chromium():
    found = check_layout.find_chromium(None)
    if found is None:
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    return found


def test_a_clipped_code_line_and_a_wide_table_are_found(tmp_path, chromium, capsys):
    (tmp_path / "fits.html").write_text(PAGE.format(
        body="<pre>x = 1  # a short line</pre><table><tr><td>a</td><td>b</td></tr></table>"))
    assert check_layout.main([str(tmp_path), "--chromium", chromium]) == 0
    assert "1 pages at 1280 px, 0 clipped" in capsys.readouterr().out
    long = "y = 2  # " + "a result comment that runs past the block " * 3
    (tmp_path / "clips.html").write_text(PAGE.format(
        body=f"<pre>x = 1\n{long}</pre>"
             "<table style='width: 900px'><tr><th>collective</th><th>size</th></tr></table>"))
    assert check_layout.main([str(tmp_path), "--chromium", chromium]) == 1
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("clips.html: a code line wider than its block") and "y = 2" in line
               for line in out), out
    assert any(line.startswith("clips.html: a table wider than the column (900 px in 500 px)")
               and "collective | size" in line for line in out), out
    assert not any(line.startswith("fits.html") for line in out), out
    assert not list(tmp_path.glob(".*.layout.html"))  # the probes are removed


def test_no_browser_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "page.html").write_text(PAGE.format(body="<pre>x</pre>"))
    assert check_layout.main([str(tmp_path), "--chromium", "/nonexistent/chromium"]) == 2
    assert "no Chromium found" in capsys.readouterr().err
