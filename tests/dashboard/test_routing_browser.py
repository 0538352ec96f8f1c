"""The routing views in a real headless Chromium (the browser suite's driver and helpers): the run
page's layer x step heatmap of routing flips draws, a click on a cell opens the sample with the
most flips there, and that sample's page names where its routing first flips."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from isoaudit.dashboard.pages import sample, urls
from isoaudit.dashboard.pages.run import ids

from tests.dashboard.test_browser import (  # the suite's skips, driver fixture and helpers
    EC,
    ActionChains,
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
def routed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[int, str]]]:
    from tests.audit.routing_records import routed_run

    with serving_store(tmp_path_factory.mktemp("routing-browser") / "isoaudit.db", routed_run) as served:
        yield served


def test_routing_heatmap_click_opens_the_sample_and_its_routing(routed_server, browser) -> None:  # noqa: F811
    url, keys = routed_server
    driver = browser
    driver.get(url + urls.run_path("moe-run"))
    layer = _wait(driver).until(
        EC.presence_of_element_located((By.CSS_SELECTOR, f"#{ids.ROUTING} .nsewdrag"))
    )
    _no_dialog(driver)
    # Three steps (x) by two MoE layers (y, layer 0 on top): the cell of step 2, layer 2.
    size = layer.size
    ActionChains(driver).move_to_element_with_offset(
        layer, int(size["width"] * (5 / 6 - 0.5)), int(size["height"] * (3 / 4 - 0.5))
    ).click().perform()
    _wait(driver).until(EC.url_contains(f"/steps/2/samples/{keys[2]}"))
    first = _wait(driver).until(EC.presence_of_element_located((By.ID, sample.ROUTING_FIRST)))
    assert first.text == "layer 0"
    _wait(driver).until(
        EC.presence_of_element_located((By.CSS_SELECTOR, f"#{sample.ROUTING_GRID} .nsewdrag"))
    )
    _screenshot(driver, "sample-routing")
    assert not _severe(driver)
