"""Token metrics of the train–rollout mismatch (DESIGN.md, "Metrics"), one concept a module:

* :mod:`.core`: the statistics of Δ = trainer − rollout per token, each defined once from additive
  sufficient statistics, per sample and pooled per step (and per completion-length bucket);
* :mod:`.families`: threshold figures (importance-weight caps, rejection bounds), families generated
  from one table each;
* :mod:`.keys`: the grammar of stored keys (``kl_k3/len_0_256``, ``kl_k3/lag_1``, ``tis_mean[cap=3]``);
* :mod:`.lags`: policy lag and the figures sliced by it.

Import the public names from here.
"""

from isoaudit.audit.metrics.core import (
    METRIC_DESCRIPTIONS,
    SAMPLE_AVERAGED,
    SAMPLE_METRICS,
    STEP_METRICS,
    sample_and_step_metrics,
    sample_metrics,
    step_metrics,
    topk_entropy,
)
from isoaudit.audit.metrics.families import (
    LOG_RATIO_BOUND,
    PARAMETRIC,
    RS_OPTIONS,
    TIS_FAMILY,
    Parametric,
    ParamValue,
)
from isoaudit.audit.metrics.keys import (
    LAG_SLICED,
    LENGTH_BUCKET_EDGES,
    LENGTH_BUCKETS,
    lag_key,
    length_bucket_of,
    length_key,
    parse_lag_key,
    parse_length_key,
    parse_variant,
    variant_key,
)
from isoaudit.audit.metrics.lags import UNKNOWN_LAG, lag_metrics

__all__ = [
    "LAG_SLICED",
    "LENGTH_BUCKETS",
    "LENGTH_BUCKET_EDGES",
    "LOG_RATIO_BOUND",
    "METRIC_DESCRIPTIONS",
    "PARAMETRIC",
    "RS_OPTIONS",
    "SAMPLE_AVERAGED",
    "SAMPLE_METRICS",
    "STEP_METRICS",
    "TIS_FAMILY",
    "UNKNOWN_LAG",
    "ParamValue",
    "Parametric",
    "lag_key",
    "lag_metrics",
    "length_bucket_of",
    "length_key",
    "parse_lag_key",
    "parse_length_key",
    "parse_variant",
    "sample_and_step_metrics",
    "sample_metrics",
    "step_metrics",
    "topk_entropy",
    "variant_key",
]
