"""r3bridge's metrics, one import for everything: what shows replay working, named alike in every
framework (every formula and every key: ``docs/metrics.md``).

* ``mismatch``  - train-vs-rollout log-prob mismatch (:func:`logprob_mismatch`, ...)
* ``agreement`` - route agreement offline (:func:`route_agreement`) and online (:class:`AgreementCounter`,
  fed by the Megatron driver), expert load
* ``naming``    - how a phase's driver metrics are named and summarised (:func:`summarize_layers`, :func:`tag_phase`)
"""
from r3bridge.metrics.agreement import AgreementCounter, AgreementReport, expert_load, route_agreement, topk_sets_equal
from r3bridge.metrics.mismatch import (
    DEFAULT_TAUS,
    MetricsInputError,
    logprob_mismatch,
    logprob_mismatch_packed,
    logprob_mismatch_sums,
    mismatch_from_sums,
)
from r3bridge.metrics.naming import WORST_LAYERS, summarize_layers, tag_phase

__all__ = [
    "MetricsInputError", "logprob_mismatch", "logprob_mismatch_packed", "logprob_mismatch_sums",
    "mismatch_from_sums", "topk_sets_equal", "route_agreement", "AgreementReport",
    "AgreementCounter", "expert_load", "tag_phase", "summarize_layers", "WORST_LAYERS", "DEFAULT_TAUS",
]
