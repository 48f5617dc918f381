"""Open a tandem-report page in headless Chromium: a screenshot, or the page's DOM after its
scripts ran.

    python scripts/report_screenshot.py outputs/sweeps/quickstart/report.html docs/report.png
    python scripts/report_screenshot.py report.html shot.png --fragment "run=1&step=40" \\
        --height 2400

Chromium comes from the distribution (Debian: ``apt-get install chromium``).
tests/report/test_report.py uses `dump_dom` to check a page renders; the README's
screenshot is made with `screenshot`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _run(
    html_path: str, fragment: str, extra: list[str], timeout_s: float
) -> subprocess.CompletedProcess:
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError(
            "no Chromium found (" + ", ".join(NAMES) + "); on Debian: apt-get install chromium"
        )
    url = "file://" + os.path.abspath(html_path) + (f"#{fragment}" if fragment else "")
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        # no shared profile lock
        cmd = [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=15000",
            *extra,
            url,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)


def console_lines(stderr: str) -> list[str]:
    """The page's console messages (errors, uncaught exceptions, logs) from Chromium's log."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def dump_dom(html_path: str, fragment: str = "", timeout_s: float = 120) -> tuple[str, list[str]]:
    """The serialised DOM after the page's scripts ran, and its console messages."""
    r = _run(html_path, fragment, ["--dump-dom"], timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"chromium exited {r.returncode}: {r.stderr[-2000:]}")
    return r.stdout, console_lines(r.stderr)


def screenshot(
    html_path: str,
    png_path: str,
    width: int = 1400,
    height: int = 1600,
    fragment: str = "",
    timeout_s: float = 120,
) -> list[str]:
    """Write a PNG of the page's first ``height`` pixels; returns the console messages."""
    r = _run(
        html_path,
        fragment,
        [f"--screenshot={os.path.abspath(png_path)}", f"--window-size={width},{height}"],
        timeout_s,
    )
    if r.returncode != 0 or not os.path.exists(png_path):
        raise RuntimeError(f"chromium exited {r.returncode} without {png_path}: {r.stderr[-2000:]}")
    return console_lines(r.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("html")
    p.add_argument("png")
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--height", type=int, default=1600)
    p.add_argument(
        "--fragment", default="", help="e.g. run=0&step=12: the sample browser's run and step"
    )
    args = p.parse_args()
    try:
        console = screenshot(args.html, args.png, args.width, args.height, args.fragment)
    except (FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in console:
        print(f"console: {line}", file=sys.stderr)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
