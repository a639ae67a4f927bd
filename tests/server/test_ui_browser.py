"""The block-map page in a real headless Chromium against a real server under load.

Needs Debian's browser and driver (no browser download):
``apt-get install -y chromium chromium-driver``; skipped with that line when missing.
While streaming conversations that share a prefix run, the page's canvas shows used and
shared blocks (read back as pixels), hovering a block names the request holding it, and
the page's counts match /metrics within one update.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.settings import ServerSettings
from tests.server.conftest import TINY_MODEL_NAME, LiveServer, build_tiny, live_server

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
APT_LINE = "apt-get install -y chromium chromium-driver"
KEY = "browser-key-31c"
SHARED_PROMPT = "Once upon a time in a land of paged attention and shared prefixes, " * 6
NUM_STREAMS = 6

# Building the tiny model dominates on a loaded machine; the page checks take about a minute.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _require_browser() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: {APT_LINE}")
    pytest.importorskip("selenium", reason="pip install selenium (the dev extra)")


@pytest.fixture(scope="module")
def locked_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    _require_browser()
    # Torch kernels: this test is about the page, not the native ops (no JIT build needed).
    built = build_tiny(tiny_model_dir, kernels="torch")
    settings = ServerSettings(served_model_names=(TINY_MODEL_NAME,), api_key=KEY)
    with live_server(built, settings) as live:
        yield live


@pytest.fixture(scope="module")
def browser(locked_server: LiveServer) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1200"):
        options.add_argument(arg)
    options.add_argument("--disable-dev-shm-usage")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


class Load:
    """Streaming completions sharing a long prompt (one first, so the rest hit its cached
    prefix and share its blocks) that run until ``stop()``."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._stop = threading.Event()
        self._started = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def start(self) -> None:
        self._spawn()
        assert self._started.acquire(timeout=120), "the first stream never started"
        for _ in range(NUM_STREAMS - 1):
            self._spawn()
        for _ in range(NUM_STREAMS - 1):
            assert self._started.acquire(timeout=120), "a stream never started"

    def _spawn(self) -> None:
        thread = threading.Thread(target=self._stream, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _stream(self) -> None:
        import openai

        client = openai.OpenAI(base_url=f"{self._url}/v1", api_key=KEY, max_retries=0, timeout=300)
        try:
            stream = client.completions.create(
                model=TINY_MODEL_NAME,
                prompt=SHARED_PROMPT,
                max_tokens=850,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            first = True
            for _ in stream:
                if first:
                    self._started.release()
                    first = False
                if self._stop.is_set():
                    break
            stream.close()
        except BaseException as exc:
            self.errors.append(exc)
            self._started.release()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


def metric(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"{name} {labels} not in /metrics"
    return float(match.group(1))


PAGE_COUNTS = """
const t = document.getElementById('requests').dataset;
const used = document.getElementById('count-used').textContent.replace(/,/g, '');
return {seq: Number(document.body.dataset.seq || 0), running: Number(t.running),
        waiting: Number(t.waiting), used: Number(used),
        steps: kvui.state.snap ? kvui.state.snap.totals.steps_total : -1};
"""

CANVAS_PIXELS = """
const canvas = document.getElementById('map-device');
const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
const key = (c) => c.join(',');
const used = key(kvui.palette.used);
const shared = new Set(kvui.palette.shared.map(key));
let nUsed = 0, nShared = 0;
for (let i = 0; i < data.length; i += 4) {
  const k = data[i] + ',' + data[i + 1] + ',' + data[i + 2];
  if (k === used) nUsed++; else if (shared.has(k)) nShared++;
}
return {used: nUsed, shared: nShared, dataUsed: Number(canvas.dataset.used),
        dataShared: Number(canvas.dataset.shared)};
"""


def wait_until(driver: Any, script: str, timeout_s: float = 90) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(
        lambda d: d.execute_script(script)
    )


def open_page_with_key(driver: Any, url: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{url}/ui")
    wait_until(driver, "return !document.getElementById('key-form').hidden")
    driver.find_element(By.ID, "key-input").send_keys(KEY)
    driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
    wait_until(driver, "return Number(document.body.dataset.seq || 0) > 0")
    assert driver.execute_script("return sessionStorage.getItem('kvserve-api-key')") == KEY


def test_block_map_page_under_load(locked_server: LiveServer, browser: Any) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    url = locked_server.url
    open_page_with_key(browser, url)  # first, so the load is young when the checks run
    load = Load(url)
    load.start()
    try:
        assert not load.errors, load.errors
        # The planner shows the server's per-token figure, computed the same way.
        assert browser.execute_script("return kvui.plan(1024, 4).matches_server")

        # 1. Used and shared blocks on the canvas, as pixels of their colours.
        wait_until(
            browser,
            "const c = document.getElementById('map-device');"
            "return Number(c.dataset.used) > 0 && Number(c.dataset.shared) > 0;",
        )
        pixels = browser.execute_script(CANVAS_PIXELS)
        assert pixels["used"] > 0 and pixels["shared"] > 0, pixels

        # 2. Hovering a shared block names the requests that hold it.
        hover_text = hover_a_shared_block(browser, ActionChains, By)
        ids = browser.execute_script("return kvui.state.snap.requests.map(r => r.id)")
        named = [rid for rid in ids if rid in hover_text]
        assert len(named) >= 2, hover_text  # shared: at least two holders
        assert "tokens" in hover_text

        # 3. Clicking a request highlights it (the row survives the next re-render).
        clicked = click_a_running_row(browser, By)
        assert browser.execute_script("return kvui.state.selected") == clicked
        wait_until(
            browser,
            "const r = document.querySelector('#requests tbody tr.selected');"
            f"return r !== null && r.dataset.id === {clicked!r} && "
            f"Number(document.body.dataset.seq) > 0;",
        )

        # 4. The live counts match /metrics within one update.
        check_counts_against_metrics(browser, url)
    finally:
        load.stop()
    assert not load.errors, load.errors
    locked_server.wait_idle(60)


def hover_a_shared_block(driver: Any, action_chains: Any, by: Any) -> str:
    canvas = driver.find_element(by.ID, "map-device")
    for _ in range(10):
        block = driver.execute_script(
            "const p = kvui.state.pools[0]; return p.refs.findIndex(r => r > 1);"
        )
        assert block >= 0
        centre = driver.execute_script("return kvui.cellCenter('device', arguments[0])", block)
        size = canvas.size
        action_chains(driver).move_to_element_with_offset(
            canvas, int(centre["x"] - size["width"] / 2), int(centre["y"] - size["height"] / 2)
        ).perform()
        tooltip = driver.find_element(by.ID, "tooltip")
        text: str = tooltip.text
        if tooltip.is_displayed() and "shared" in text:
            return text
    raise AssertionError("no hover text for a shared block")


def click_a_running_row(driver: Any, by: Any) -> str:
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(20):  # the table is re-rendered on every snapshot
        try:
            row = driver.find_element(by.CSS_SELECTOR, "#requests tbody tr[data-state=running]")
            request_id: str = row.get_attribute("data-id")
            row.click()
            return request_id
        except StaleElementReferenceException:
            continue
    raise AssertionError("could not click a running request's row")


def check_counts_against_metrics(driver: Any, url: str) -> None:
    """Read the page, scrape /metrics, wait for a page update captured after the scrape:
    each metric lies between the page's two readings.

    Ordered by engine steps, not by arrival: a snapshot can be captured before the scrape
    and drawn after it, so "after" is the first one whose ``steps_total`` exceeds the
    scrape's. The streams only grow while none finishes (same running count before and
    after), which is what makes "between" exact; a reading across a finish is retried.
    """
    auth = {"Authorization": f"Bearer {KEY}"}
    checks = 0
    for _ in range(15):
        before = driver.execute_script(PAGE_COUNTS)
        scrape = httpx.get(f"{url}/metrics", headers=auth).text
        steps = metric(scrape, "kvserve_engine_steps_total")
        assert before["steps"] <= steps, (before, steps)
        after = wait_until(
            driver,
            PAGE_COUNTS.replace(
                "return {",
                f"if (!(kvui.state.snap.totals.steps_total > {steps})) return null; return {{",
            ),
        )
        if before["running"] != after["running"]:
            continue  # a stream finished in between: its blocks went back to the pool
        metrics = {
            "running": metric(scrape, "kvserve_num_requests_running"),
            "waiting": metric(scrape, "kvserve_num_requests_waiting"),
            "used": metric(scrape, "kvserve_kv_cache_blocks", 'pool="device",state="used"'),
        }
        for key, value in metrics.items():
            low, high = sorted((before[key], after[key]))
            assert low <= value <= high, (key, before, value, after)
        checks += 1
        if checks == 5:
            return
    raise AssertionError(f"only {checks} of 5 readings without a stream finishing")
