"""The dashboard in a real headless Chromium (Debian's chromium + chromedriver, driven by Selenium),
against a database filled by a real collector run that keeps running while the browser works."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dash
import pytest
from isoaudit.dashboard.pages import alerts, contract, runs, sample, urls
from isoaudit.dashboard.pages.run import ids

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"

if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip("needs Debian's chromium and chromium-driver (make system-deps)", allow_module_level=True)
pytest.importorskip("selenium")
pytest.importorskip("triton", reason="the collector run's invariant mode needs triton (the kernels extra)")

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import NoAlertPresentException, StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from tests.dashboard.collector_run import XSS_NAME, CollectorRun  # noqa: E402


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorRun]:
    base = tmp_path_factory.mktemp("dashboard-browser")
    run = CollectorRun(f"sqlite:///{base / 'isoaudit.db'}", base / "model").start()
    try:
        run.wait_for_steps(3)
        yield run
    finally:
        run.stop()


@contextmanager
def serving(app: dash.Dash) -> Iterator[str]:
    """``app`` served over HTTP on a free local port, in a thread; yields its base URL."""
    from werkzeug.serving import make_server

    http = make_server("127.0.0.1", 0, app.server, threaded=True)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{http.server_port}"
    finally:
        http.shutdown()


@contextmanager
def serving_store(path: Path, fill: Callable[[Any], Any]) -> Iterator[tuple[str, Any]]:
    """A SQLite store at ``path``, filled by ``fill(store)``, served by the dashboard; yields its
    base URL and what ``fill`` returned."""
    from isoaudit.audit.db import Store
    from isoaudit.dashboard import create_app

    store = Store(f"sqlite:///{path}")
    try:
        found = fill(store)
        with serving(create_app(store, live_interval_ms=1000)) as url:
            yield url, found
    finally:
        store.dispose()


@pytest.fixture(scope="module")
def server(collector: CollectorRun) -> Iterator[str]:
    from isoaudit.audit.db import Store
    from isoaudit.dashboard import create_app

    store = Store(collector.url)
    try:
        with serving(create_app(store, live_interval_ms=1000)) as url:
            yield url
    finally:
        store.dispose()


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: webdriver.Chrome, timeout: float = 30) -> WebDriverWait:
    return WebDriverWait(driver, timeout, poll_frequency=0.2)


def _screenshot(driver: webdriver.Chrome, name: str) -> None:
    """The whole page, not just the window."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.body.scrollHeight")
    driver.set_window_size(1400, max(1000, min(int(height) + 100, 6000)))
    time.sleep(0.5)
    driver.save_screenshot(str(ARTIFACTS / f"dashboard-{name}.png"))
    driver.set_window_size(1400, 1000)


def _no_dialog(driver: webdriver.Chrome) -> None:
    try:
        alert = driver.switch_to.alert
    except NoAlertPresentException:
        return
    text = alert.text
    alert.dismiss()
    pytest.fail(f"a dialog opened: {text!r}")


def _click(driver: webdriver.Chrome, locator: tuple[str, str], timeout: float = 30) -> None:
    """Click the element once it is there; live pages redraw, so a stale element is looked up again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _wait(driver, timeout).until(EC.element_to_be_clickable(locator)).click()
            return
        except StaleElementReferenceException:
            if time.monotonic() > deadline:
                raise


def _severe(driver: webdriver.Chrome) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def test_every_page_against_a_live_collector_run(
    collector: CollectorRun, server: str, browser: webdriver.Chrome
):
    driver = browser
    run_id = collector.run_id
    run_url = server + urls.run_path(run_id)

    # ---------------------------------------------------------------- runs page: the name is text
    driver.get(server + urls.RUNS)
    table = _wait(driver).until(EC.presence_of_element_located((By.ID, runs.TABLE_BODY)))
    assert XSS_NAME in table.text
    assert not driver.find_elements(By.CSS_SELECTOR, "img[src='x']")
    _no_dialog(driver)
    _wait(driver).until(
        EC.presence_of_element_located((By.CSS_SELECTOR, f"#{runs.TABLE_BODY} .main-svg"))
    )  # sparkline
    _screenshot(driver, "runs")

    # ---------------------------------------------------------------- run page
    _click(driver, (By.LINK_TEXT, XSS_NAME))
    _wait(driver).until(EC.presence_of_element_located((By.CSS_SELECTOR, f"#{ids.POSITION} .nsewdrag")))
    assert driver.find_element(By.ID, ids.TITLE).text == XSS_NAME
    assert not driver.find_elements(By.CSS_SELECTOR, "img[src='x']")
    _no_dialog(driver)
    _wait(driver).until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#{ids.SAMPLES} td"))
    # The loop's own figures (Session.record_stats) are drawn beside the mismatch.
    _wait(driver).until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#{ids.LOOP} .scatterlayer .trace"))
    assert "reward (mean)" in driver.find_element(By.ID, ids.LOOP).text
    _screenshot(driver, "run")

    # A cell of the step x position heatmap opens the sample holding that cell's largest |Δ|.
    cell_layer = driver.find_element(By.CSS_SELECTOR, f"#{ids.POSITION} .nsewdrag")
    ActionChains(driver).move_to_element(cell_layer).click().perform()
    _wait(driver).until(EC.url_contains("/samples/"))
    named = _wait(driver).until(EC.presence_of_element_located((By.ID, sample.FIRST_DIVERGENCE)))
    assert named.text.startswith(("embed", "layers.", "final_norm", "logits")), named.text
    assert driver.find_element(By.ID, sample.DIAGNOSIS).text in {"numerical", "inconclusive", "clean"}
    _wait(driver).until(EC.presence_of_element_located((By.CSS_SELECTOR, f"#{sample.GRID} .nsewdrag")))
    _screenshot(driver, "sample")

    # ---------------------------------------------------------------- the remediation toggle
    driver.get(run_url)
    _wait(driver).until(EC.presence_of_element_located((By.ID, ids.MODE)))
    driver.find_element(By.CSS_SELECTOR, f"#{ids.MODE} input[value='invariant']").click()
    _wait(driver).until(EC.presence_of_element_located((By.ID, ids.CONTROL_OK)))
    control = collector.store.get_control(run_id)
    assert (control.mode, control.version, control.updated_by) == ("invariant", 1, "dashboard")
    # The collector, still running, switches at its next step boundary and says so in its manifests.
    for side in ("trainer", "rollout"):
        _wait(driver, 240).until(
            EC.text_to_be_present_in_element((By.ID, ids.applied_mode(side)), "invariant"),
            message=f"the {side} never reported invariant",
        )
    _screenshot(driver, "run-invariant")

    # A change made elsewhere meanwhile is shown, not overwritten.
    collector.store.set_control(run_id, "native", 1, updated_by="someone-else")
    driver.find_element(By.CSS_SELECTOR, f"#{ids.MODE} input[value='native']").click()
    conflict = _wait(driver).until(EC.presence_of_element_located((By.ID, ids.CONTROL_CONFLICT)))
    assert "someone-else" in conflict.text
    assert collector.store.get_control(run_id).version == 2

    # ---------------------------------------------------------------- contract page
    driver.get(server + urls.contract_path(run_id))
    rows = _wait(driver).until(
        EC.presence_of_all_elements_located((By.CSS_SELECTOR, f"#{contract.FIELDS} tr.{contract.DIFFERS}"))
    )
    assert any(row.text.startswith("runtime.framework") for row in rows)
    assert "Handshake" in driver.find_element(By.ID, contract.VERDICT).text
    _screenshot(driver, "contract")

    # ---------------------------------------------------------------- alerts page
    driver.get(server + urls.ALERTS)
    _wait(driver).until(EC.presence_of_element_located((By.ID, alerts.RULES)))
    assert "any_mismatch" in driver.find_element(By.ID, alerts.CONTENT).text
    links = driver.find_elements(By.CSS_SELECTOR, f"#{alerts.CONTENT} a[href*='?step=']")
    assert links, "no alert links to its step"
    driver.find_element(By.ID, alerts.SILENCE_RUN).send_keys(run_id)
    driver.find_element(By.ID, alerts.SILENCE_CREATE).click()
    _wait(driver).until(EC.text_to_be_present_in_element((By.ID, alerts.SILENCE_MESSAGE), "created"))
    _wait(driver).until(EC.presence_of_element_located((By.CSS_SELECTOR, f"#{alerts.SILENCES} button")))
    _screenshot(driver, "alerts")
    _click(driver, (By.CSS_SELECTOR, f"#{alerts.SILENCES} button"))
    _wait(driver).until(EC.text_to_be_present_in_element((By.ID, alerts.SILENCES), "expired"))

    _no_dialog(driver)
    assert _severe(driver) == []
