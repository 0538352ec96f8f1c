"""``stale_engine_state`` on the dashboard in a real headless Chromium (the browser suite's driver
and helpers): the run page's diagnosis bars draw it in its own colour and its step's samples table
names it; the sample page names it with its sentence and the canary evidence."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from isoaudit.dashboard.figures import DIAGNOSIS_COLOURS
from isoaudit.dashboard.pages import sample, urls
from isoaudit.dashboard.pages.run import ids

from tests.dashboard.test_browser import (  # the suite's skips, driver fixture and helpers
    EC,
    By,
    _no_dialog,
    _screenshot,
    _severe,
    _wait,
    browser,  # noqa: F401  (a fixture)
    serving_store,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def stale_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[int, str]]]:
    from tests.audit.stale_records import stale_run

    with serving_store(tmp_path_factory.mktemp("stale-browser") / "isoaudit.db", stale_run) as served:
        yield served


def _rgb(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


def test_stale_engine_state_on_the_run_and_sample_pages(stale_server, browser) -> None:  # noqa: F811
    url, keys = stale_server
    driver = browser
    driver.get(url + urls.run_path("stale-run", step=1))
    bars = _wait(driver).until(
        EC.presence_of_element_located((By.CSS_SELECTOR, f"#{ids.DIAGNOSES} .legendtext"))
    )
    assert bars is not None
    _no_dialog(driver)
    legend = [e.text for e in driver.find_elements(By.CSS_SELECTOR, f"#{ids.DIAGNOSES} .legendtext")]
    assert "stale_engine_state" in legend and "clean" in legend
    colour = _rgb(DIAGNOSIS_COLOURS["stale_engine_state"])
    fills = {
        e.get_attribute("style").split("fill: ")[1].split(";")[0]
        for e in driver.find_elements(By.CSS_SELECTOR, f"#{ids.DIAGNOSES} .bars path")
        if "fill: " in (e.get_attribute("style") or "")
    }
    assert colour in fills, fills
    table = _wait(driver).until(EC.text_to_be_present_in_element((By.ID, ids.SAMPLES), "stale_engine_state"))
    assert table
    _screenshot(driver, "run-stale-engine-state")

    driver.get(url + urls.sample_path("stale-run", 1, keys[1]))
    _wait(driver).until(EC.text_to_be_present_in_element((By.ID, sample.DIAGNOSIS), "stale_engine_state"))
    sentence = driver.find_element(By.ID, sample.SENTENCE).text
    assert sentence.startswith("Stale engine state: both sides hold the same weights")
    assert "hold old weights" in sentence and "vLLM's LLM.generate" in sentence
    page = driver.find_element(By.TAG_NAME, "body").text
    assert "canaries_differ_under_one_arithmetic" in page and "rollout_canary_digest" in page
    _screenshot(driver, "sample-stale-engine-state")
    assert not _severe(driver)
