"""The embedded default end to end, as a newcomer runs it: README.md's snippet pasted into a job that
writes to ``./isoaudit.db`` (no database or service configured), then ``isoaudit dashboard`` over
that file, with no other command. A real headless Chromium sees the compared steps on the run page,
the first divergence on a sample page and the alert on the alerts page. And where nothing compares
(a job run with ``compare="none"`` and no worker), the pages say so, with the command that does."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.dashboard.test_serve import dashboard
from tests.test_readme import readme_snippet

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
ROOT = Path(__file__).resolve().parents[2]

if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip("needs Debian's chromium and chromium-driver (make system-deps)", allow_module_level=True)
pytest.importorskip("selenium")

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import (  # noqa: E402
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

#: The README's snippet runs a tiny float32 Qwen3 against isoaudit's reference engine (serving a copy
#: with a planted fault, see PREAMBLE): their logprobs differ slightly, far under the default kl_k3
#: rules (sized for real models), so the job's environment names a rules file, as README's
#: configuration table says (ISOAUDIT_ALERT_RULES), with a rule that fires on any token whose bits differ.
RULES = """\
rules:
  - name: any_bitwise_mismatch
    metric: exact_match_fraction
    comparison: "<"
    threshold: 1.0
    severity: warning
"""

#: What the snippet expects to exist: the policy, the engine, prompts, lengths and the step count.
#: The engine serves its own copy of the policy with one weight 0.1 % off (a planted fault): on some
#: CPUs the HF forward and the engine's packed steps agree bit for bit, and the run must have a
#: divergence to show on every machine.
PREAMBLE = """\
import copy
import numpy as np
import torch
from isoaudit.collectors.tiny_models import load_tiny_model
from isoaudit.kernels.adapters import HFCausalLM
from isoaudit.kernels.engine import RolloutEngine

policy, _ = load_tiny_model({model!r})
served = copy.deepcopy(policy)
with torch.no_grad():
    served.model.layers[1].mlp.down_proj.weight[0, 0] *= 1.001
engine = RolloutEngine(HFCausalLM(served), max_len=64)
rng = np.random.default_rng(0)
prompts = [rng.integers(3, 500, n).tolist() for n in (5, 9, 3)]
max_new = [4, 6, 2]
steps = 3
"""


def run_readme_job(directory: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The snippet as a job file in ``directory`` (its working directory, so the store is
    ``directory/isoaudit.db``), run as its own process with no isoaudit destination configured."""
    from isoaudit.collectors.tiny_models import make_tiny_model

    model = make_tiny_model("qwen3", directory / "model", num_layers=2, hidden=64, vocab=512, seed=3)
    job = directory / "job.py"
    job.write_text(PREAMBLE.format(model=str(model)) + "\n" + readme_snippet())
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ISOAUDIT_")}
    environ["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, str(job)],
        cwd=directory,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


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


def _text_when(driver: webdriver.Chrome, css: str, *parts: str) -> str:
    """The text of the element at ``css`` once it holds every one of ``parts``, read whole at each
    poll: a live page redraws it (a run just written ticks), and an element found on one poll may
    be gone by the next read."""
    seen = [""]

    def holds(d: webdriver.Chrome) -> str | bool:
        try:
            seen[0] = d.find_element(By.CSS_SELECTOR, css).text
        except (NoSuchElementException, StaleElementReferenceException):  # not drawn yet, or redrawn
            return False
        return seen[0] if all(part in seen[0] for part in parts) else False

    try:
        return _wait(driver).until(holds)
    except TimeoutException as exc:
        raise AssertionError(f"{css}: expected {parts}, last read {seen[0]!r}") from exc


def _screenshot(driver: webdriver.Chrome, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.body.scrollHeight")
    driver.set_window_size(1400, max(1000, min(int(height) + 100, 6000)))
    time.sleep(0.5)
    driver.save_screenshot(str(ARTIFACTS / f"embedded-{name}.png"))
    driver.set_window_size(1400, 1000)


def _severe(driver: webdriver.Chrome) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def _fresh(driver: webdriver.Chrome) -> webdriver.Chrome:
    """The shared browser on a blank page with its log read out: what an earlier test's live page
    logged after its server went away is not this test's."""
    driver.get("about:blank")
    driver.get_log("browser")
    return driver


def test_the_readme_job_then_the_dashboard_alone_shows_steps_divergence_and_alert(
    tmp_path: Path, browser: webdriver.Chrome
) -> None:
    from isoaudit.dashboard.pages import alerts, runs, sample, urls
    from isoaudit.dashboard.pages.run import ids

    (tmp_path / "rules.yaml").write_text(RULES)
    job = run_readme_job(tmp_path, {"ISOAUDIT_ALERT_RULES": str(tmp_path / "rules.yaml")})
    # The session compared its run before it closed, and said so.
    assert "isoaudit run grpo-7: trainer sent" in job.stderr and "3 steps compared" in job.stderr
    assert "[FIRING] any_bitwise_mismatch" in job.stderr  # the comparer's log channel, in the job's log
    assert (tmp_path / "isoaudit.db").exists()

    driver = _fresh(browser)
    with dashboard(tmp_path, "--workers", "2") as (_, port, _log):
        base = f"http://127.0.0.1:{port}"

        # ---------------------------------------------------------------- runs page
        driver.get(base + urls.RUNS)
        _text_when(driver, f"#{runs.TABLE_BODY}", "grpo-7")  # a live list: its tick redraws the table
        assert not driver.find_elements(By.CSS_SELECTOR, f"#{runs.BACKLOG}.alert")  # nothing waits
        _screenshot(driver, "runs")

        # ---------------------------------------------------------------- run page: compared steps
        driver.find_element(By.LINK_TEXT, "grpo-7").click()
        _wait(driver).until(EC.presence_of_element_located((By.CSS_SELECTOR, f"#{ids.POSITION} .nsewdrag")))
        timelines = driver.find_element(By.ID, ids.TIMELINES)
        assert "no compared steps yet" not in timelines.text
        assert timelines.find_elements(By.CSS_SELECTOR, ".scatterlayer .trace")
        rows = _wait(driver).until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#{ids.SAMPLES} tr td"))
        assert rows
        assert not driver.find_elements(By.CSS_SELECTOR, f"#{ids.BACKLOG}.alert")
        _screenshot(driver, "run")

        # ---------------------------------------------------------------- a sample: its first divergence
        # Step 0 is fingerprinted on both sides (sample_every=10): its samples have a region grid.
        driver.get(base + urls.run_path("grpo-7", 0))
        _wait(driver).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, f"#{ids.SAMPLES} a[href*='/samples/']")
        )
        links = [
            a.get_attribute("href")
            for a in driver.find_elements(By.CSS_SELECTOR, f"#{ids.SAMPLES} a[href*='/samples/']")
        ]
        located = []
        for href in links:
            driver.get(href)
            named = _wait(driver).until(EC.presence_of_element_located((By.ID, sample.FIRST_DIVERGENCE)))
            if named.text != "none located":
                located.append(named.text)
                _wait(driver).until(
                    EC.presence_of_element_located((By.CSS_SELECTOR, f"#{sample.GRID} .nsewdrag"))
                )
                _screenshot(driver, "sample")
                break
        assert located and located[0].startswith(("embed", "layers.", "final_norm", "logits")), located

        # ---------------------------------------------------------------- alerts page
        driver.get(base + urls.ALERTS)
        content = _wait(driver).until(EC.presence_of_element_located((By.ID, alerts.CONTENT)))
        _wait(driver).until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#{alerts.OPEN} tr td"))
        open_alerts = driver.find_element(By.ID, alerts.OPEN).text
        assert "any_bitwise_mismatch" in open_alerts and "grpo-7" in open_alerts and "firing" in open_alerts
        assert content.find_elements(By.CSS_SELECTOR, f"#{alerts.OPEN} a[href*='?step=']")
        _screenshot(driver, "alerts")
        assert _severe(driver) == []
        driver.get("about:blank")  # no live page left polling a server about to stop


@contextmanager
def serving(app: object) -> Iterator[str]:
    """A Dash app served over HTTP on a free local port, in a thread; yields its base URL."""
    from werkzeug.serving import make_server

    http = make_server("127.0.0.1", 0, app.server, threaded=True)  # type: ignore[attr-defined]
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{http.server_port}"
    finally:
        http.shutdown()


def test_pages_say_when_steps_wait_with_no_worker(tmp_path: Path, browser: webdriver.Chrome) -> None:
    """The same job run with ``ISOAUDIT_COMPARE=none`` and no worker: the runs list and the run page
    say that its steps wait and name the command; once a worker compared them, the banner goes."""
    from isoaudit.audit.db import Store
    from isoaudit.audit.worker import ComparisonWorker
    from isoaudit.dashboard import create_app
    from isoaudit.dashboard.pages import runs, urls
    from isoaudit.dashboard.pages.run import ids

    job = run_readme_job(tmp_path, {"ISOAUDIT_COMPARE": "none"})
    assert "steps compared" not in job.stderr
    store = Store(f"sqlite:///{tmp_path / 'isoaudit.db'}")
    command = f"isoaudit worker --database-url 'sqlite:///{tmp_path / 'isoaudit.db'}'"
    driver = _fresh(browser)
    try:
        with serving(create_app(store, live_interval_ms=500, stalled_after_s=1.0)) as base:
            driver.get(base + urls.RUNS)
            # the run is live (just written): the list's tick redraws the banner, so read it whole
            _text_when(
                driver, f"#{runs.BACKLOG}.alert", "3 steps (9 samples) have both sides stored", command
            )
            _screenshot(driver, "runs-waiting")

            driver.get(base + urls.run_path("grpo-7"))
            # The run is live (just written): its tick redraws the banner, so read it whole each time.
            _wait(driver).until(EC.presence_of_element_located((By.CSS_SELECTOR, f"#{ids.BACKLOG}.alert")))
            _wait(driver).until(
                lambda d: (
                    command in d.find_element(By.ID, ids.BACKLOG_SLOT).text
                    and "no comparison worker" in d.find_element(By.ID, ids.BACKLOG_SLOT).text
                )
            )
            assert not driver.find_elements(
                By.CSS_SELECTOR, f"#{ids.TIMELINES} .scatterlayer .trace"
            )  # none compared
            _screenshot(driver, "run-waiting")

            ComparisonWorker(store).run_once()
            driver.get(base + urls.RUNS)
            _wait(driver).until(EC.presence_of_element_located((By.ID, runs.TABLE_BODY)))
            assert not driver.find_elements(By.CSS_SELECTOR, f"#{runs.BACKLOG}.alert")
            severe = _severe(driver)
            assert severe == [], severe
            driver.get("about:blank")
    finally:
        store.dispose()
