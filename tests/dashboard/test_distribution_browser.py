"""The sample page's full-distribution view in a real headless Chromium: a run whose rollout
distribution was perturbed off the sampled token (a real HF model, every sampled-token logprob
bitwise equal) shows, token by token, where the two sides' distributions part."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from isoaudit.dashboard.pages import sample, urls

from tests.dashboard.test_browser import (  # the suite's skips, driver fixture and helpers
    EC,
    By,
    _no_dialog,
    _screenshot,
    _severe,
    _wait,
    browser,  # noqa: F401  (a fixture)
    serving,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def planted_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    import torch
    from isoaudit.audit.db import Store
    from isoaudit.audit.records import Run
    from isoaudit.audit.worker import ComparisonWorker
    from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model
    from isoaudit.dashboard import create_app

    from tests.collectors.test_distribution import RUN, make_batch, planted_head, record

    base = tmp_path_factory.mktemp("distribution-browser")
    model, _ = load_tiny_model(
        make_tiny_model("qwen3", base / "qwen3", num_layers=2, hidden=64, vocab=512, seed=7)
    )
    torch.manual_seed(0)
    batch = make_batch()
    trainer = record(model, batch, side="trainer")
    with planted_head(model, batch):
        rollout = record(model, batch, side="rollout")
    store = Store(f"sqlite:///{base / 'isoaudit.db'}")
    store.ingest([Run(run_id=RUN, name="planted distribution"), *trainer, *rollout])
    ComparisonWorker(store).run_once()
    try:
        with serving(create_app(store, live_interval_ms=1000)) as url:
            yield url, [str(s.sample_key) for s in trainer]
    finally:
        store.dispose()


def test_sample_page_shows_where_the_distributions_part(planted_server, browser) -> None:  # noqa: F811
    url, keys = planted_server
    driver = browser
    driver.get(url + urls.sample_path(RUN_ID, 0, keys[0]))
    summary = _wait(driver).until(EC.presence_of_element_located((By.ID, sample.DISTRIBUTION_SUMMARY)))
    _no_dialog(driver)
    assert "differ at" in summary.text and "first at completion token 0" in summary.text
    assert "bitwise equal" in summary.text
    assert driver.find_element(By.ID, sample.DIAGNOSIS).text == "numerical"
    assert "the full distributions differ" in driver.find_element(By.ID, sample.SENTENCE).text
    _wait(driver).until(
        EC.presence_of_element_located((By.CSS_SELECTOR, f"#{sample.DISTRIBUTION_TRACE} .nsewdrag"))
    )
    traces = driver.find_elements(By.CSS_SELECTOR, f"#{sample.DISTRIBUTION_TRACE} .scatterlayer .trace")
    assert len(traces) == 4  # TV, Hellinger, overlap, the "sampled equal, differs" marks
    bands = driver.find_elements(
        By.CSS_SELECTOR, f"#{sample.DISTRIBUTION_TRACE} .layer-below .shapelayer path"
    )
    assert len(bands) >= 1
    _screenshot(driver, "sample-distribution")
    assert not _severe(driver)


RUN_ID = "dist-planted"
