"""Check every page of the built documentation in a real browser: no clipped code, no wide table.

    python -m sphinx -W -b html docs /tmp/html
    python docs/check_layout.py /tmp/html                 # every page, a 1280 px window
    python docs/check_layout.py /tmp/html --width 1024 --chromium /usr/bin/chromium

Each page is opened in headless Chromium (Debian's ``chromium`` package: ``apt-get
install chromium``) with a script added at its end that measures, once the page's
styles are in:

* every code block (``pre``): a line wider than the block, so that the block
  scrolls sideways and hides its end (a result comment such as ``# every rank:
  [60. 64. ...`` cut off);
* every table: wider than the page's content column (furo's ``article``).

The script writes what it found into the page, Chromium prints the page
(``--dump-dom``), and this program reads it back: no driver and no Python package
beyond the standard library.  It prints one line per problem (page, what, the
widths, the start of the line or the table's header) and exits 1 if there is one;
2 if the browser cannot run.  The browser runs with a fresh profile, no network
services and no sandbox (CI runs as root); it opens only the files given.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MARK = "mpicoll-layout-report"

# Runs at the end of the page: every pre and table measured against its column.
MEASURE = """
<script>
(function () {
  var column = document.querySelector("article[role=main]") || document.body;
  var width = column.clientWidth;
  var found = [];
  document.querySelectorAll("pre").forEach(function (pre) {
    if (pre.scrollWidth > pre.clientWidth + 1) {
      var lines = pre.textContent.split("\\n");
      var longest = lines.reduce(function (a, b) { return b.length > a.length ? b : a; }, "");
      found.push({kind: "code", scroll: pre.scrollWidth, client: pre.clientWidth,
                  text: longest.slice(0, 100)});
    }
  });
  document.querySelectorAll("table").forEach(function (table) {
    var w = table.getBoundingClientRect().width;
    if (w > width + 1) {
      var head = table.querySelector("tr");
      var cells = head ? Array.prototype.map.call(head.children, function (c) {
        return c.textContent.replace(/\\s+/g, " ").trim(); }) : [];
      found.push({kind: "table", scroll: Math.round(w), client: width,
                  text: cells.join(" | ").slice(0, 100)});
    }
  });
  var out = document.createElement("pre");
  out.id = "MARK";
  out.textContent = JSON.stringify({column: width, found: found});
  document.body.appendChild(out);
})();
</script>
""".replace("MARK", MARK)

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--disable-default-apps", "--disable-extensions", "--hide-scrollbars",
         "--allow-file-access-from-files")


def find_chromium(given: str | None) -> str | None:
    if given:
        return given if shutil.which(given) else None
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def measure(chromium: str, page: Path, width: int, height: int = 900,
            timeout: float = 60) -> dict:
    """{"column": px, "found": [...]} of one HTML page (a copy beside it, with the script)."""
    text = page.read_text(encoding="utf-8")
    probe = page.with_name(f".{page.stem}.layout.html")  # beside it: the same relative links
    where = text.rfind("</body>")
    probe.write_text(text[:where] + MEASURE + text[where:] if where >= 0 else text + MEASURE,
                     encoding="utf-8")
    try:
        with tempfile.TemporaryDirectory(prefix="mpicoll-layout-") as profile:
            run = subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}",
                                  f"--window-size={width},{height}", "--dump-dom",
                                  probe.resolve().as_uri()],
                                 capture_output=True, text=True, timeout=timeout)
    finally:
        probe.unlink()
    m = re.search(rf'<pre id="{MARK}">(.*?)</pre>', run.stdout, re.S)
    if not m:
        raise RuntimeError(f"{page.name}: the browser gave no report (exit status "
                           f"{run.returncode}): {run.stderr.strip()[-300:]}")
    return json.loads(html.unescape(m.group(1)))


def pages(build: Path) -> list[Path]:
    """The built pages (not Sphinx's search and index pages)."""
    skip = {"search.html", "genindex.html", "py-modindex.html"}
    return sorted(p for p in build.glob("*.html") if p.name not in skip
                  and not p.name.startswith("."))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python docs/check_layout.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("build", type=Path, help="the HTML build folder (sphinx -b html docs BUILD)")
    p.add_argument("--width", type=int, default=1280, help="the window's width in px (default 1280)")
    p.add_argument("--chromium", help="the browser (default: chromium on PATH)")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                   help="pages measured at once (default: the cores, at most 4)")
    args = p.parse_args(argv)
    chromium = find_chromium(args.chromium)
    if chromium is None:
        print("check_layout.py: no Chromium found (apt-get install chromium, or --chromium)",
              file=sys.stderr)
        return 2
    todo = pages(args.build)
    if not todo:
        print(f"check_layout.py: no HTML pages in {args.build}", file=sys.stderr)
        return 2
    problems = 0
    try:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            reports = list(pool.map(lambda page: measure(chromium, page, args.width), todo))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"check_layout.py: {exc}", file=sys.stderr)
        return 2
    for page, report in zip(todo, reports):
        for f in report["found"]:
            problems += 1
            what = ("a code line wider than its block" if f["kind"] == "code"
                    else "a table wider than the column")
            print(f"{page.name}: {what} ({f['scroll']} px in {f['client']} px): {f['text']!r}")
    print(f"check_layout.py: {len(todo)} pages at {args.width} px, "
          f"{problems} clipped code blocks or wide tables")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
