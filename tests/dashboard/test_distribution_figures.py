"""The sample page's distribution figure on hand-built frames."""

from __future__ import annotations

import numpy as np
import pandas as pd
from isoaudit.audit.db.reads import SampleDistribution
from isoaudit.dashboard import data, figures


def found(differs: list[bool], sampled_equal: list[bool]) -> SampleDistribution:
    n = len(differs)
    return SampleDistribution(
        prompt_len=3,
        k=8,
        overlap=np.where(differs, 0.875, 1.0),
        rank_agreement=np.where(differs, 0.75, 1.0),
        tv=np.where(differs, 1e-3, 0.0),
        kl=np.where(differs, 1e-4, 0.0),
        hellinger=np.full(n, np.nan),
        sampled_equal=np.array(sampled_equal),
        differs=np.array(differs),
    )


def test_bands_where_the_distributions_part_and_marks_where_the_sampled_logprob_hides_it() -> None:
    frame = data.distribution_frame(found([False, True, True, False], [True, True, False, True]))
    assert frame["absolute_position"].tolist() == [3, 4, 5, 6]
    fig = figures.distribution_trace(frame, 8)
    names = [t.name for t in fig.data]
    assert names == ["TV on top-8 union", "Hellinger (full-vocab sketch)", "top-k overlap",
                     "sampled logprob equal, distribution differs"]  # fmt: skip
    assert list(fig.data[3].x) == [1]  # differs with the sampled logprob bitwise equal
    bands = fig.layout.shapes
    assert [(s.x0, s.x1) for s in bands] == [(0.5, 1.5), (1.5, 2.5)]
    assert bands[0].fillcolor == "#d62728" and bands[1].fillcolor == "#ff7f0e"
    assert list(fig.data[0].y)[0] == 10.0**figures.LOG_FLOOR  # an exact zero sits at the floor
    assert all(v is None for v in fig.data[1].y)  # no sketch: no Hellinger points


def test_nothing_to_draw() -> None:
    fig = figures.distribution_trace(pd.DataFrame(columns=["position"]))
    assert fig.layout.annotations[0].text == "no positions with a top-k on both sides"
    agree = figures.distribution_trace(data.distribution_frame(found([False] * 3, [True] * 3)))
    assert not agree.layout.shapes and len(agree.data) == 3
