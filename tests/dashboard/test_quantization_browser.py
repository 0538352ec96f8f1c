"""The ``quantization`` cause in a real headless Chromium: real reference-engine FP8 records (per-tensor
dynamic activation scales on both sides, the rollout's batch probe) through ``Store.ingest`` and the
comparison worker; the run page draws the cause in its colour, the sample page names it with its
sentence."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from isoaudit.dashboard.figures import DIAGNOSIS_COLOURS
from isoaudit.dashboard.pages import sample, urls
from isoaudit.dashboard.pages.run import ids

from tests import factories
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

RUN_ID = "fp8-run"


@pytest.fixture(scope="module")
def quant_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    from isoaudit.audit.worker import ComparisonWorker

    from tests.kernels.quant_records import mode, records
    from tests.kernels.test_e2e import _hf

    model = _hf("qwen3", 2, 128, 32, 256, torch.float32, "cpu")
    ts, rs, tm, rm, _ = records(
        model, model, lambda: mode(True, "tensor"), lambda: mode(True, "tensor"), run_id=RUN_ID
    )

    def fill(store: Any) -> list[str]:
        store.ingest([factories.run(RUN_ID)])
        result = store.ingest([tm, rm, *ts, *rs])
        assert not result.rejected, result.rejected
        ComparisonWorker(store).run_once(RUN_ID)
        return [t.sample_key for t in ts]

    with serving_store(tmp_path_factory.mktemp("quant-browser") / "isoaudit.db", fill) as served:
        yield served


def test_quantization_on_the_run_and_sample_pages(quant_server, browser) -> None:  # noqa: F811
    url, keys = quant_server
    driver = browser
    driver.get(url + urls.run_path(RUN_ID))
    _wait(driver).until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#{ids.SAMPLES} td"))
    _no_dialog(driver)
    _wait(driver).until(lambda d: "quantization" in d.find_element(By.TAG_NAME, "body").text)
    colour = DIAGNOSIS_COLOURS["quantization"]
    fills = driver.execute_script(
        "return Array.from(document.querySelectorAll('.point path, .bars path'))"
        ".map(p => getComputedStyle(p).fill || p.style.fill)"
    )
    rgb = "rgb({}, {}, {})".format(*(int(colour[i : i + 2], 16) for i in (1, 3, 5)))
    _screenshot(driver, "run-quantization")
    assert rgb in fills, (rgb, sorted(set(fills))[:20])

    driver.get(url + urls.sample_path(RUN_ID, 0, keys[0]))
    kind = _wait(driver).until(EC.presence_of_element_located((By.ID, sample.DIAGNOSIS)))
    assert kind.text == "quantization"
    sentence = driver.find_element(By.ID, sample.SENTENCE).text
    assert "batch composition" in sentence and "cannot be made exact" in sentence, sentence
    _screenshot(driver, "sample-quantization")
    assert not _severe(driver)
