"""What changed, in a real headless Chromium (the browser suite's driver and helpers): the contract
page of a run names, between the sides and against another run, a planted library and backend
change (vLLM's version, the rollout's attention backend); the sample page of the step where a
mismatch appeared says what changed since the last clean step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from isoaudit.collectors.environment import process_environment
from isoaudit.dashboard.pages import contract_changes, sample, urls

from tests.audit.environment_records import (
    BASE_ATTENTION,
    PLANTED_ATTENTION,
    PLANTED_VLLM,
    drifting_run,
    planted_runs,
)
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
def env_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from isoaudit.audit.worker import ComparisonWorker

    def fill(store: Any) -> None:
        planted_runs(store)
        drifting_run(store, change_at=3, steps=5)
        ComparisonWorker(store).run_once()

    with serving_store(tmp_path_factory.mktemp("environment-browser") / "isoaudit.db", fill) as (url, _):
        yield url


def _rows(driver, table_id: str) -> list[list[str]]:
    table = _wait(driver).until(EC.presence_of_element_located((By.ID, table_id)))
    return [
        [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        for tr in table.find_elements(By.CSS_SELECTOR, "tbody tr")
    ]


def test_the_contract_page_names_the_planted_change(env_server: str, browser) -> None:  # noqa: F811
    driver = browser
    driver.get(env_server + urls.contract_path("env-b"))
    sides = _rows(driver, contract_changes.SIDES_TABLE)
    _no_dialog(driver)
    assert ["env-b trainer → env-b rollout", "backends", "attention", "sdpa", PLANTED_ATTENTION] in sides
    # Against run A: the link the page offers, then the rollout's two planted changes, nothing else.
    link = _wait(driver).until(
        EC.element_to_be_clickable(
            (By.CSS_SELECTOR, f"#{contract_changes.AGAINST_LINKS} a[href$='against=env-a']")
        )
    )
    driver.execute_script("arguments[0].click()", link)  # below the fold of the headless window
    _wait(driver).until(EC.url_contains("against=env-a"))
    against = _rows(driver, contract_changes.AGAINST_TABLE)
    assert [r[1:3] for r in against] == [["versions", "vllm"], ["backends", "attention"]]
    assert all(r[0] == "env-b rollout → env-a rollout" for r in against)
    assert against[0][4] != PLANTED_VLLM and against[0][3] == PLANTED_VLLM
    assert against[1][3:] == [PLANTED_ATTENTION, BASE_ATTENTION]
    _screenshot(driver, "contract-what-changed")
    assert not _severe(driver), _severe(driver)


def test_the_drifting_run_says_what_changed_since_the_last_clean_step(env_server: str, browser) -> None:  # noqa: F811
    driver = browser
    driver.get(env_server + urls.contract_path("env-drift"))
    previous = _rows(driver, contract_changes.PREVIOUS_TABLE)
    assert any(r[1:3] == ["versions", "vllm"] and r[4] == PLANTED_VLLM for r in previous), previous
    driver.get(env_server + urls.run_path("env-drift", 3))
    link = _wait(driver).until(EC.element_to_be_clickable((By.CSS_SELECTOR, "a[href*='/steps/3/samples/']")))
    driver.get(link.get_attribute("href"))
    verdict = _wait(driver).until(EC.presence_of_element_located((By.ID, sample.SENTENCE)))
    _wait(driver).until(lambda d: "Changed since the last clean step 2" in verdict.text)
    assert f"vllm {process_environment().versions['vllm']} → {PLANTED_VLLM}" in verdict.text
    assert f"attention {BASE_ATTENTION} → {PLANTED_ATTENTION}" in verdict.text
    _screenshot(driver, "sample-changed-since-clean")
    assert not _severe(driver), _severe(driver)
