#!/usr/bin/env python3
"""ui_load.py URL [--runs N] — the built-in web page's weight and load time (issue 46).

Weight: the page's files as the server sends them (HTML, JS, CSS, icon), raw and gzip -9.
Load time: headless Chromium (Debian's /usr/bin/chromium via Playwright), a fresh browser
context per run, navigation start to the page ready (`body[data-ready=true]`: the modules ran,
/v1/models answered) and to the load event; median and spread of N runs.

    host serve --port 8080 &   then   python bench/ui_load.py http://127.0.0.1:8080/
"""
import argparse
import gzip
import statistics
import time
import urllib.request

from playwright.sync_api import sync_playwright

FILES = ["/", "/ui/app.js", "/ui/api.js", "/ui/chat.js", "/ui/console.js", "/ui/markdown.js", "/ui/style.css",
         "/ui/icon.svg"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("--runs", type=int, default=10)
    a = ap.parse_args()
    base = a.url.rstrip("/")
    raw = zipped = 0
    print("| file | bytes | gzip -9 |\n|---|---|---|")
    for f in FILES:
        req = urllib.request.Request(base + f, headers={"Accept": "text/html"})
        body = urllib.request.urlopen(req).read()
        z = len(gzip.compress(body, 9))
        raw, zipped = raw + len(body), zipped + z
        print(f"| {f} | {len(body):,} | {z:,} |")
    print(f"| all | {raw:,} | {zipped:,} |\n")
    ready, load = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
        for _ in range(a.runs + 1):
            context = browser.new_context()
            page = context.new_page()
            start = time.perf_counter()
            page.goto(base + "/")
            page.wait_for_selector("body[data-ready=true]")
            ready.append((time.perf_counter() - start) * 1e3)
            load.append(page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd"))
            context.close()
        browser.close()
    ready, load = ready[1:], load[1:]  # the first run warms the browser
    print("| measure | median ms | min-max ms |\n|---|---|---|")
    for name, xs in [("navigation to ready (modules ran, /v1/models answered)", ready), ("load event", load)]:
        print(f"| {name} | {statistics.median(xs):.0f} | {min(xs):.0f}-{max(xs):.0f} |")


if __name__ == "__main__":
    main()
