"""Open the built documentation site in a real headless browser and check that it renders: the home page, one
algorithm page and the configuration reference load with their navigation, a navigation link leads to its page,
and the search box finds a configuration key. Not part of the test suite (it needs Chromium and Playwright):

    mkdocs build --strict -d site && python tests/site_in_browser.py site [--chromium /usr/bin/chromium]

Prints one line per check and writes screenshots next to the site (site-shots/); exits 1 on a failed check.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
import threading
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("site", type=Path)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(args.site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    shots = args.site.parent / "site-shots"
    shots.mkdir(exist_ok=True)
    failures = 0

    def check(name: str, ok: bool, detail: str = "") -> None:
        nonlocal failures
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page()
        for path, heading in (("/", "flowrl"), ("/algorithms/branch-grpo/", "BranchGRPO"),
                              ("/reference/config/", "Configuration reference")):
            page.goto(base + path)
            h1 = page.locator("article h1").first.inner_text()
            nav = page.locator("nav.md-nav--primary a.md-nav__link").count()
            rows = page.locator("article table tr").count()
            page.screenshot(path=str(shots / f"{path.strip('/').replace('/', '_') or 'home'}.png"), full_page=False)
            check(f"{path} renders", heading in h1 and nav > 10, f"h1 {h1!r}, {nav} navigation links, {rows} table rows")
        page.goto(base + "/")
        page.locator("nav.md-nav--primary a.md-nav__link", has_text="Concepts").first.click()
        page.wait_for_load_state()
        check("navigation link to Concepts", page.url.rstrip("/").endswith("/concepts"), page.url)
        page.goto(base + "/")
        page.keyboard.press("/")  # the theme's shortcut to the search box
        page.locator("input.md-search__input").fill("kl_untrained_beta")
        page.wait_for_selector(".md-search-result__item", timeout=15000)
        hits = page.locator(".md-search-result__item").count()
        first = page.locator(".md-search-result__item").first.inner_text().splitlines()[0]
        page.screenshot(path=str(shots / "search.png"))
        check("search finds kl_untrained_beta", hits > 0, f"{hits} results, first {first!r}")
        browser.close()
    server.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
