"""The dashboard in a real headless browser (Debian's chromium driven by Playwright): the live
page under load and the memory bench's static report. `make install` installs both; where they
cannot be had these tests skip and say why.

PAGEDLLM_DASHBOARD_PNG=docs/dashboard.png saves the screenshot under load where the README
shows it (`make dashboard-screenshot`)."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time

import httpx
import pytest

from pagedllm.cli import main as cli_main
from tests.server.conftest import API_KEY, RunningServer, metric_value, tiny_config

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed: pip install playwright (make install does)")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHROMIUM = os.environ.get("PAGEDLLM_CHROMIUM") or shutil.which("chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
TOOLTIP = re.compile(r"^block 0: (free|used|shared|cached|copying), ref count \d+, \d+/4 tokens\n"
                     r"(owners \(\d+\): cmpl-.+|no owner)$")
# The legend's counts, by state name.
COUNTS_JS = """(panel) => Object.fromEntries(
    [...document.querySelectorAll(`[data-layout="${panel}"] .legend li`)]
    .map(li => [li.dataset.state, +li.querySelector('.count').textContent]))"""
BUSY_JS = "(counts) => counts.used + counts.shared + counts.copying"


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed: apt-get install -y chromium (make install "
                    "does, as root); or set PAGEDLLM_CHROMIUM to a chromium binary")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


class WatchedPage:
    """A page that records its console errors, uncaught exceptions and every URL it asked for."""

    def __init__(self, browser, viewport=(1280, 860)) -> None:
        self.page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
        self.errors: list[str] = []
        self.requested: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("request", lambda request: self.requested.append(request.url))

    def counts(self, panel: str) -> dict[str, int]:
        return self.page.evaluate(COUNTS_JS, panel)

    def wait_counts(self, panel: str, condition_js: str, timeout_s: float = 30) -> None:
        wait_until(self.page, f"() => ({condition_js})(({COUNTS_JS})({panel!r}))", timeout_s)

    def close(self) -> None:
        self.page.close()


def wait_until(page, predicate_js: str, timeout_s: float = 30) -> None:
    """Poll a JS predicate from here. Playwright's wait_for_function polls by evaluating a string
    inside the page, which the dashboard's Content-Security-Policy (no unsafe-eval) refuses as soon
    as the first check is false; page.evaluate goes through the debugger protocol instead."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(predicate_js):
        if time.monotonic() > deadline:
            raise TimeoutError(f"still false after {timeout_s} s: {predicate_js}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def live_server(tiny_model_dir, one_torch_thread):
    config = tiny_config(tiny_model_dir, num_kv_blocks=384, block_size=4, max_num_seqs=48)
    with RunningServer(config, api_key=API_KEY) as running:
        yield running


class Load:
    """Clients sending completions until stopped: short and long, some sampling n=2 (shared
    blocks, copy-on-write), most starting with one prompt (prefix-cache hits)."""

    def __init__(self, base_url: str, num_clients: int = 24) -> None:
        self.base_url = base_url
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(num_clients)]

    def _client(self, i: int) -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
            k = 0
            while not self.stop.is_set():
                k += 1
                prompt = "A shared system prompt. " + "question " * ((i + k) % 4)
                client.post(f"{self.base_url}/v1/completions",
                            json={"prompt": prompt, "max_tokens": 8 + 4 * ((i * 7 + k) % 7),
                                  "n": 2 if (i + k) % 4 == 0 else 1, "temperature": 1.0})

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def test_the_live_page_draws_the_cache_under_load_and_all_free_after(live_server, browser, tmp_path):
    base = live_server.base_url
    watched = WatchedPage(browser, viewport=(1280, 560))
    page = watched.page
    page.goto(f"{base}/#key={API_KEY}")  # the fragment never reaches the server
    wait_until(page, "() => document.getElementById('status').textContent === 'live'")
    assert "key" not in page.url  # taken out of the address bar at once
    num_blocks = int(metric_value(base, "kv_cache_blocks_total"))
    assert page.inner_text("[data-figure=num_blocks]") == str(num_blocks) == "384"
    watched.wait_counts("KV cache blocks", f"c => c.free + c.cached === {num_blocks}")

    with Load(base):
        watched.wait_counts("KV cache blocks", f"c => ({BUSY_JS})(c) > 8")
        seen = set()
        for _ in range(8):  # the grid moves while requests run
            seen.add(tuple(sorted(watched.counts("KV cache blocks").items())))
            time.sleep(0.3)
        assert len(seen) > 1, seen
        readme_picture = os.environ.get("PAGEDLLM_DASHBOARD_PNG")
        if readme_picture:
            time.sleep(15)  # some history in the plots
        box = page.locator("[data-role=grid]").bounding_box()
        page.mouse.move(box["x"] + 2, box["y"] + 2)  # block 0
        assert TOOLTIP.match(page.inner_text("#tooltip")), page.inner_text("#tooltip")
        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        if readme_picture:
            shutil.copyfile(shot, readme_picture)
        page.mouse.move(0, 0)

    live_server.wait_idle()
    watched.wait_counts("KV cache blocks", f"c => ({BUSY_JS})(c) === 0 && c.free + c.cached === {num_blocks}")
    assert page.inner_text("[data-figure=running]") == "0"
    assert watched.errors == []
    assert all(url.startswith(base) for url in watched.requested), watched.requested
    watched.close()


def test_the_page_asks_for_the_key_and_keeps_it_for_the_tab(live_server, browser):
    watched = WatchedPage(browser)
    page = watched.page
    page.goto(live_server.base_url + "/dashboard")
    page.wait_for_selector("#key-form:not([hidden])")
    assert page.inner_text("#status") == "API key needed"
    page.fill("#key-input", "wrong")
    page.click("#key-form button")
    wait_until(page, "() => document.getElementById('status').textContent === 'wrong API key'")
    page.fill("#key-input", API_KEY)
    page.click("#key-form button")
    wait_until(page, "() => document.getElementById('status').textContent === 'live'")
    assert page.is_hidden("#key-form")
    page.reload()  # sessionStorage: this tab keeps it
    wait_until(page, "() => document.getElementById('status').textContent === 'live'")
    # The browser reports each refused request as a console error; nothing else may appear.
    assert all("401" in error for error in watched.errors) and len(watched.errors) == 2, watched.errors
    watched.close()


def test_the_memory_report_plays_both_layouts_side_by_side(tiny_model_dir, browser, tmp_path):
    report = tmp_path / "memory.html"
    assert cli_main(["bench", "memory", "--simulate", "--model", str(tiny_model_dir),
                     "--num-prompts", "24", "--input-len", "8-24", "--output-len", "8-32",
                     "--max-model-len", "64", "--reservations", "4", "--block-size", "4",
                     "--plot", "", "--html", str(report)]) == 0
    watched = WatchedPage(browser, viewport=(1400, 900))
    page = watched.page
    page.goto(report.as_uri())
    assert [p.get_attribute("data-layout") for p in page.locator(".panel").all()] == \
        ["paged", "contiguous"]
    for layout in ("paged", "contiguous"):
        panel = page.locator(f'[data-layout="{layout}"]')
        assert panel.locator("[data-figure=num_blocks]").inner_text() == "64"
        assert "waste" in panel.locator("[data-role=summary]").inner_text()

    def at(position: int) -> None:
        page.fill("#cursor", str(position))
        page.dispatch_event("#cursor", "input")

    def waste_pct(layout: str) -> float:
        return float(page.locator(f'[data-layout="{layout}"] [data-figure=waste]').inner_text()[:-1])

    at(50)  # both runs are busy early on
    for layout in ("paged", "contiguous"):
        assert page.evaluate(BUSY_JS, watched.counts(layout)) > 0
    assert watched.counts("contiguous")["used"] % 16 == 0  # whole reservations of max_model_len
    assert waste_pct("paged") < 20 < 40 < waste_pct("contiguous")
    at(1000)  # the end: everything given back
    for layout in ("paged", "contiguous"):
        assert watched.counts(layout)["free"] == 64
    page.click("#play")  # plays from the start without errors
    time.sleep(0.5)
    page.click("#play")
    assert watched.errors == []
    assert watched.requested == [report.as_uri()]  # nothing fetched: it works offline
    watched.close()
