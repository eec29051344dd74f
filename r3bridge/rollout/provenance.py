"""The one provenance rule of first-seen routes: where a sample stitched from its engine calls got
its routes, and where it got the log-probs they are paired with.

The earliest tokens keep the first call's rows (first-seen), so the sample's routes are that
call's engine pass: its weight version, its re-prefill epoch, its attempt. The first tokens'
log-probs were sampled in that request's first pass (epoch 0, where the engine reports epochs),
under the weight version the sampling ran with, and the sample keeps the tokens (and log-probs)
of its last call's attempt. What an engine reports of its pass is read by one reader per engine
format (:func:`r3bridge.batch.provenance.vllm_provenance` for vLLM-style outputs,
:func:`~r3bridge.batch.provenance.sglang_provenance` for SGLang's ``meta_info``) and fed to
:func:`first_seen_provenance`; "Route provenance" in docs/architecture.md.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from r3bridge.batch.provenance import RouteProvenance
from r3bridge.errors import ProvenanceError

__all__ = ["first_seen_provenance"]


def first_seen_provenance(first_pass: RouteProvenance, *, sampled_version: Optional[int], calls: int = 1,
                          attempts: Optional[Sequence[int]] = None) -> tuple[RouteProvenance, RouteProvenance]:
    """(where a sample's routes came from, where its log-probs came from) for ``calls`` engine calls
    stitched first-seen, ``first_pass`` being what the engine reported of the first call's pass
    (read by the engine format's reader). The routes are that pass; the log-probs are the same
    request's first pass (epoch 0 where ``first_pass`` knows its epoch, else unknown) under
    ``sampled_version`` (the weight version the first tokens were sampled with; ``None``: unknown).
    ``attempts`` (one per call, in call order; ``None``: the framework does not number them): the
    routes are the first call's attempt, the log-probs (and tokens) the last call's."""
    sample = first_pass.request_id or "?"
    if not calls:
        raise ProvenanceError(f"sample {sample}: no server call to take provenance from")
    if attempts is not None and len(attempts) != calls:
        raise ProvenanceError(f"sample {sample}: {len(attempts)} attempts for {calls} server calls")
    first, last = (first_pass.attempt, None) if attempts is None else (attempts[0], attempts[-1])
    routes = replace(first_pass, attempt=first)
    logprobs = RouteProvenance(first_pass.engine, first_pass.request_id, sampled_version,
                               None if first_pass.epoch is None else 0, last)
    return routes, logprobs
