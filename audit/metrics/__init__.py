"""Token metrics of the train–rollout mismatch (DESIGN.md, "Metrics"), one concept a module:

* :mod:`.core`: the statistics of Δ = trainer − rollout per token, each defined once from additive
  sufficient statistics, per sample and pooled per step (and per completion-length bucket);
* :mod:`.families`: threshold figures (importance-weight caps, rejection bounds), families generated
  from one table each;
* :mod:`.keys`: the grammar of stored keys (``kl_k3/len_0_256``, ``kl_k3/lag_1``, ``tis_mean[cap=3]``);
* :mod:`.lags`: policy lag (staleness, token- and sample-weighted) and the figures sliced by it;
* :mod:`.noise`: noise versus bias of Δ by response length;
* :mod:`.exact`: what fail-closed reads of a compared step (any non-identical token).

Import the public names from here.
"""

from isoaudit.audit.metrics.core import (
    METRIC_DESCRIPTIONS,
    SAMPLE_AVERAGED,
    SAMPLE_METRICS,
    STEP_METRICS,
    UNSLICED_DESCRIPTIONS,
    sample_and_step_metrics,
    sample_metrics,
    step_metrics,
    topk_entropy,
)
from isoaudit.audit.metrics.exact import (
    EXACT_KEYS,
    Exactness,
    ExactnessError,
    NotIdentical,
    ParityUnverified,
)
from isoaudit.audit.metrics.families import (
    BAND_FAMILY,
    LOG_RATIO_BOUND,
    PARAMETRIC,
    RS_OPTIONS,
    STANDING_BANDS,
    TIS_FAMILY,
    Parametric,
    ParamValue,
)
from isoaudit.audit.metrics.keys import (
    LAG_SLICED,
    LENGTH_BUCKET_EDGES,
    LENGTH_BUCKETS,
    STANDING_VARIANTS,
    lag_key,
    length_bucket_of,
    length_key,
    parse_lag_key,
    parse_length_key,
    parse_variant,
    variant_description,
    variant_key,
)
from isoaudit.audit.metrics.lags import STALENESS_DESCRIPTIONS, UNKNOWN_LAG, lag_metrics
from isoaudit.audit.metrics.noise import (
    NOISE_DESCRIPTIONS,
    NOISE_FIT,
    NOISE_FIT_MIN_SAMPLES,
    NOISE_SLICED,
    noise_verdict,
)

__all__ = [
    "BAND_FAMILY",
    "EXACT_KEYS",
    "LAG_SLICED",
    "LENGTH_BUCKETS",
    "LENGTH_BUCKET_EDGES",
    "LOG_RATIO_BOUND",
    "METRIC_DESCRIPTIONS",
    "NOISE_DESCRIPTIONS",
    "NOISE_FIT",
    "NOISE_FIT_MIN_SAMPLES",
    "NOISE_SLICED",
    "PARAMETRIC",
    "RS_OPTIONS",
    "SAMPLE_AVERAGED",
    "SAMPLE_METRICS",
    "STALENESS_DESCRIPTIONS",
    "STANDING_BANDS",
    "STANDING_VARIANTS",
    "STEP_METRICS",
    "TIS_FAMILY",
    "UNKNOWN_LAG",
    "UNSLICED_DESCRIPTIONS",
    "Exactness",
    "ExactnessError",
    "NotIdentical",
    "ParamValue",
    "Parametric",
    "ParityUnverified",
    "lag_key",
    "lag_metrics",
    "length_bucket_of",
    "length_key",
    "noise_verdict",
    "parse_lag_key",
    "parse_length_key",
    "parse_variant",
    "sample_and_step_metrics",
    "sample_metrics",
    "step_metrics",
    "topk_entropy",
    "variant_description",
    "variant_key",
]
