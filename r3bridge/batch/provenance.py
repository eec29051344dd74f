"""Where a sequence's routes came from, and the check that they came from the pass its log-probs did.

Routes and log-probs of one sample can come from different engine passes while every shape
matches: SGLang retracts a request during an async weight update, re-prefills it and returns the
re-prefill's routes with the first pass's log-probs (miles #3277); vLLM drops a preempted request's
routes without a word (vLLM #39917). Nothing in the routes themselves shows it, so each sequence of
a :class:`r3bridge.ReplayBatch` may carry a :class:`RouteProvenance` (engine, request id, weight
version, re-prefill / retraction epoch, attempt), filled by the adapter from what its framework
reports, and the driver compares it with the provenance of the log-probs the routes are paired with
(:func:`check_pairing`, ``ReplayConfig.provenance_check``).

Attempts (NeMo RL #4057: routes keyed by weight version, task, rollout, attempt and request id, so
a retry never overwrites an earlier attempt): a framework that generates a sample again from
scratch (a retried turn, a re-run episode) numbers its attempts. A retry's routes never stand in
for another attempt's: stitching refuses pieces of one sequence from different attempts
(:func:`r3bridge.rollout.stitching.stitch`), and routes of one attempt paired with log-probs of another
differ in ``attempt``, counted or refused per ``provenance_check``. An epoch is different: the
engine re-prefilled the *same* request (its tokens stay); an attempt regenerates them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from r3bridge.errors import PayloadError, ProvenanceError

__all__ = [
    "RouteProvenance",
    "checked_provenance",
    "concat_provenance",
    "select_provenance",
    "ProvenanceCount",
    "ProvenancePairing",
    "check_pairing",
    "CHECK_MODES",
    "versions_tensor",
    "from_versions_tensor",
    "reported_int",
    "VERSION_COLUMNS",
    "ROUTE_PROVENANCE_KEY",
    "LOGPROB_PROVENANCE_KEY",
    "provenance_fields",
    "pairing_from_fields",
    "vllm_provenance",
    "sglang_provenance",
    "ROUTE_KINDS",
    "route_label",
    "parse_route_label",
]

CHECK_MODES = ("refuse", "count", "off")
EPOCH_MAX = 2**31 - 1  # the wire format stores the epoch (and the attempt) as i32
ATTEMPT_MAX = EPOCH_MAX
_PASS_FIELDS = ("request_id", "weight_version", "epoch", "attempt")
VERSION_MAX = 2**63 - 1  # and the weight version as i64


# What a batch's routes are (docs/architecture.md, "One vocabulary"): its route kind, and for rollout
# routes the engine that produced them (``ReplayBatch.engine``, ``None``: not said). "rollout": an
# engine's choices (R3 replays them); "recorded": the trainer's own, recorded for R2; "native" /
# "dispatched": a route trace's views of a pass (the router's own top-k / what the experts ran);
# "mixed": a concat of batches of different kinds (never replayed).
ROUTE_KINDS = ("rollout", "recorded", "native", "dispatched", "mixed")


def route_label(route_kind: str, engine: str | None) -> str:
    """One word for what routes are: the engine's name for rollout routes that name one, else the
    route kind. The string the wire format stores (one field since version 1) and ``r3bridge
    inspect`` prints; :func:`parse_route_label` is its inverse."""
    return engine if route_kind == "rollout" and engine else route_kind


def parse_route_label(label: str) -> tuple[str, str | None]:
    """(route kind, engine) of a :func:`route_label`: a route kind stands for itself, any other
    word is the engine of rollout routes."""
    return (label, None) if label in ROUTE_KINDS else ("rollout", label)


def reported_int(value: Any) -> Optional[int]:
    """An engine- or framework-reported count (weight version, preemptions, retractions) as an
    int: a non-negative int (not a bool); ``None`` (unknown) for anything else, e.g. ``-1`` or
    ``None`` where the engine did not report one. Unknown fields are not compared, and samples
    without a comparable field are counted as unchecked (:class:`ProvenanceCount`)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return None
    return int(value) if int(value) >= 0 else None


def _int_field(value, what: str, limit: int) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ProvenanceError(f"{what} must be an int or None, got {value!r}")
    value = int(value.__index__())
    if not 0 <= value <= limit:
        raise ProvenanceError(f"{what} must be in [0, {limit}], got {value}")
    return value


@dataclass(frozen=True)
class RouteProvenance:
    """The engine pass a sequence's routes (or a sample's log-probs) came from.

    ``engine``: the engine or framework that produced them (``"vllm"``, ``"sglang"``, ...; never
    empty). ``request_id``: the engine's request id (``""``: unknown). ``weight_version``: the policy
    weight version the engine held (the framework's policy version or step; ``None``:
    unknown). ``epoch``: how many times the engine re-prefilled the request (retraction,
    preemption, abort and resume) before this pass (``None``: the engine does not report it).
    ``attempt``: which of the framework's tries at generating the sample from scratch this is (0:
    the first; a retried turn or re-run episode counts up; ``None``: the framework does not say).
    Fields a side does not know are not compared (:meth:`differences`)."""

    engine: str
    request_id: str = ""
    weight_version: Optional[int] = None
    epoch: Optional[int] = None
    attempt: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.engine, str) or not self.engine:
            raise ProvenanceError(f"RouteProvenance.engine must be a non-empty string, got {self.engine!r}")
        if not isinstance(self.request_id, str):
            raise ProvenanceError(f"RouteProvenance.request_id must be a string, got {self.request_id!r}")
        object.__setattr__(
            self, "weight_version", _int_field(self.weight_version, "RouteProvenance.weight_version", VERSION_MAX)
        )
        object.__setattr__(self, "epoch", _int_field(self.epoch, "RouteProvenance.epoch", EPOCH_MAX))
        object.__setattr__(self, "attempt", _int_field(self.attempt, "RouteProvenance.attempt", ATTEMPT_MAX))

    def differences(self, other: "RouteProvenance") -> tuple[str, ...]:
        """Names of the fields both sides know (non-empty / not None) whose values differ."""
        out = []
        for name in ("engine",) + _PASS_FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            if a not in (None, "") and b not in (None, "") and a != b:
                out.append(name)
        return tuple(out)

    def __str__(self) -> str:
        return (
            f"engine={self.engine} request_id={self.request_id or '?'} weight_version="
            f"{'?' if self.weight_version is None else self.weight_version} epoch="
            f"{'?' if self.epoch is None else self.epoch} attempt={'?' if self.attempt is None else self.attempt}"
        )


Provenances = tuple[Optional[RouteProvenance], ...]


def checked_provenance(
    provenance: Optional[Sequence[Optional[RouteProvenance]]], num_seqs: int
) -> Optional[Provenances]:
    """``provenance`` as a tuple of one entry per sequence (``None``: that sequence has none), or
    ``None``; raises :class:`ProvenanceError` naming the sequence."""
    if provenance is None:
        return None
    if isinstance(provenance, (str, bytes, RouteProvenance)) or not hasattr(provenance, "__len__"):
        raise ProvenanceError(
            f"provenance must be a sequence of RouteProvenance (one per sequence), got {type(provenance).__name__}"
        )
    out = tuple(provenance)
    if len(out) != num_seqs:
        raise ProvenanceError(f"provenance has {len(out)} entries for {num_seqs} sequences")
    for i, p in enumerate(out):
        if p is not None and not isinstance(p, RouteProvenance):
            raise ProvenanceError(f"sequence {i}: provenance must be a RouteProvenance or None, got {type(p).__name__}")
    return out


def select_provenance(provenance: Optional[Provenances], indices: Sequence[int]) -> Optional[Provenances]:
    return None if provenance is None else tuple(provenance[i] for i in indices)


def concat_provenance(parts: Sequence[tuple[Optional[Provenances], int]]) -> Optional[Provenances]:
    """(provenance, num_seqs) of each batch -> the concatenation's; sequences of a batch without
    provenance get ``None``; ``None`` when no part has any."""
    if all(p is None for p, _ in parts):
        return None
    out: list[Optional[RouteProvenance]] = []
    for p, n in parts:
        out.extend(p if p is not None else (None,) * n)
    return tuple(out)


@dataclass
class ProvenanceCount:
    """Samples whose route and log-prob provenance were both known and compared, those that
    differed, and those left unchecked (either side unknown)."""

    checked: int = 0
    mismatched: int = 0
    unchecked: int = 0

    def as_metrics(self, prefix: str = "r3bridge/") -> dict[str, float]:
        return {
            f"{prefix}provenance/checked_samples": float(self.checked),
            f"{prefix}provenance/mismatched_samples": float(self.mismatched),
            f"{prefix}provenance/unchecked_samples": float(self.unchecked),
        }


@dataclass(frozen=True)
class ProvenancePairing:
    """What an adapter knows of one pass's samples, in the batch's sample order: where each one's
    routes came from, where the log-probs they are paired with came from (``None``: unknown, for a
    side or a sample), and the framework's name of each sample (errors name it)."""

    routes: Optional[Sequence[Optional[RouteProvenance]]]
    logprobs: Optional[Sequence[Optional[RouteProvenance]]]
    names: Optional[Sequence[str]] = None
    # the pass's sample count: every sample is counted, checked or unchecked, also when neither
    # side is known at all (a stock agent loop: no provenance field in the batch); None: the
    # length of whichever of routes / logprobs / names is known
    samples: Optional[int] = None

    def check(self, mode: str) -> ProvenanceCount:
        return check_pairing(self.routes, self.logprobs, mode, names=self.names, samples=self.count())

    def count(self) -> int:
        if self.samples is not None:
            return int(self.samples)
        known = next((x for x in (self.routes, self.logprobs, self.names) if x is not None), ())
        return len(known)

    def select(self, indices: Sequence[int]) -> "ProvenancePairing":
        """The samples ``indices`` (e.g. those of one mini-batch), in that order."""
        idx = [int(i) for i in indices]

        def pick(xs):
            return None if xs is None else [xs[i] for i in idx]

        return ProvenancePairing(pick(self.routes), pick(self.logprobs), pick(self.names), len(idx))


# Frameworks whose batches carry per-sample data only as tensors carry provenance as
# an int64 [n, 3] tensor: (weight version, epoch, attempt), -1 = unknown, a row of -1s = no
# provenance. The engine name is the adapter's and no request id travels. [n, 2] tensors (written
# before attempts: weight version, epoch) are still read, their attempt unknown.
VERSION_COLUMNS = ("weight_version", "epoch", "attempt")


def versions_tensor(items: Sequence[Optional[RouteProvenance]]) -> torch.Tensor:
    def row(p: Optional[RouteProvenance]) -> tuple[int, ...]:
        if p is None:
            return (-1,) * len(VERSION_COLUMNS)
        return tuple(-1 if getattr(p, name) is None else getattr(p, name) for name in VERSION_COLUMNS)

    # one tensor built from the rows (not one element assignment per field and sample)
    return torch.tensor([row(p) for p in items], dtype=torch.int64).reshape(len(items), len(VERSION_COLUMNS))


def from_versions_tensor(
    t, *, engine: str, what: str, samples: Optional[int] = None
) -> list[Optional[RouteProvenance]]:
    """:func:`versions_tensor`'s inverse (also of the older ``[n, 2]`` form, attempt unknown);
    ``what`` names the field in errors; ``samples``: the row count the batch needs (one per
    sample), checked when given."""
    t = torch.as_tensor(t)
    if t.dim() != 2 or t.shape[1] not in (2, 3) or t.dtype.is_floating_point:
        raise ProvenanceError(
            f"{what} must be an integer [samples, 3] tensor (weight version, epoch, attempt; [samples, 2] without "
            f"the attempt), got {t.dtype} {list(t.shape)}"
        )
    if samples is not None and t.shape[0] != samples:
        raise ProvenanceError(f"{what} has {t.shape[0]} rows for {samples} samples")
    out: list[Optional[RouteProvenance]] = []
    for i, values in enumerate(t.tolist()):
        if all(v == -1 for v in values):
            out.append(None)
            continue
        version, epoch, attempt = (list(values) + [-1])[:3]
        try:
            out.append(RouteProvenance(engine, "", None if version == -1 else version, None if epoch == -1 else epoch,
                                       None if attempt == -1 else attempt))
        except ProvenanceError as e:
            raise ProvenanceError(f"{what}, sample {i}: {e}") from None
    return out


def check_pairing(
    routes: Optional[Sequence[Optional[RouteProvenance]]],
    logprobs: Optional[Sequence[Optional[RouteProvenance]]],
    mode: str,
    *,
    names: Optional[Sequence[str]] = None,
    samples: Optional[int] = None,
) -> ProvenanceCount:
    """Compare each sample's route provenance with its log-probs' (same order, one per sample).

    ``mode``: ``"count"`` counts mismatches, ``"refuse"`` raises :class:`ProvenanceError` naming the
    first mismatched sample (``names[i]``, else its position) and both provenances, before anything
    is installed; ``"off"`` compares nothing (returns an empty count). A sample is *checked* when
    both sides have a provenance and either their engines differ or a field that names the pass
    (request id, weight version, epoch, attempt) is known on both; a field unknown on either side is not
    compared."""
    if mode not in CHECK_MODES:
        raise ProvenanceError(f"provenance_check must be one of {', '.join(CHECK_MODES)}, got {mode!r}")
    count = ProvenanceCount()
    if mode == "off":
        return count
    n = samples if samples is not None else len(routes) if routes is not None else \
        len(logprobs) if logprobs is not None else 0
    for side, what in ((routes, "route"), (logprobs, "log-prob")):
        if side is not None and len(side) != n:
            raise ProvenanceError(f"{what} provenance for {len(side)} samples, the pass has {n}")
    first_bad = None
    for i in range(n):
        r = routes[i] if routes is not None else None
        lp = logprobs[i] if logprobs is not None else None
        if r is None or lp is None or not _comparable(r, lp):
            count.unchecked += 1
            continue
        count.checked += 1
        diff = r.differences(lp)
        if diff:
            count.mismatched += 1
            if first_bad is None:
                first_bad = (i, r, lp, diff)
    if first_bad is not None and mode == "refuse":
        i, r, lp, diff = first_bad
        name = names[i] if names is not None else f"sample {i}"
        raise ProvenanceError(
            f"{name}: its routes came from another engine pass than its log-probs ({', '.join(diff)} differ): "
            f"routes [{r}], log-probs [{lp}]; {count.mismatched} of {count.checked} checked samples differ "
            f"(provenance_check='refuse'; 'count' replays them and counts them)"
        )
    return count


def _comparable(a: RouteProvenance, b: RouteProvenance) -> bool:
    # the engine is always known: two engines differ outright; the same engine needs a field
    # that says which pass (request id, weight version or epoch) known on both sides
    return a.engine != b.engine or any(
        getattr(a, f) not in (None, "") and getattr(b, f) not in (None, "") for f in _PASS_FIELDS
    )


# ---------------------------------------------------------------------------------- batch fields
# The two per-sample fields every adapter's batch carries (the same names in every framework):
# the provenance of each sample's routes and that of the log-probs they are paired with.
ROUTE_PROVENANCE_KEY = "r3bridge_route_provenance"
LOGPROB_PROVENANCE_KEY = "r3bridge_logprob_provenance"


def provenance_fields(routes: Sequence[Optional[RouteProvenance]],
                      logprobs: Sequence[Optional[RouteProvenance]]) -> dict[str, torch.Tensor]:
    """Per-sample route and log-prob provenance -> the two ``[B, len(VERSION_COLUMNS)]`` int64 fields a
    batch that carries per-sample data only as tensors holds (:func:`versions_tensor`)."""
    if len(routes) != len(logprobs):
        raise ProvenanceError(f"route provenance for {len(routes)} samples, log-prob provenance for {len(logprobs)}")
    return {ROUTE_PROVENANCE_KEY: versions_tensor(routes), LOGPROB_PROVENANCE_KEY: versions_tensor(logprobs)}


def pairing_from_fields(get: Callable[[str], Any], *, samples: int, names: Sequence[str], engine: str,
                        framework: str) -> ProvenancePairing:
    """A batch's two provenance fields (``get(key)``; ``None``: the batch has no such field, its
    samples are counted unchecked) -> the pass's :class:`ProvenancePairing`. A field is a
    :func:`versions_tensor` (its samples name ``engine``) or a per-sample sequence of
    ``RouteProvenance`` / ``None`` (a framework's non-tensor fields). Errors name ``framework``'s field."""

    def column(key: str) -> Optional[list[Optional[RouteProvenance]]]:
        value = get(key)
        what = f"{framework} batch field {key!r}"
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            return from_versions_tensor(value, engine=engine, what=what, samples=samples)
        items = value.tolist() if hasattr(value, "tolist") else list(value)
        # a store that serialises the fields (a framework's transfer store, msgspec) hands a RouteProvenance
        # back as its fields
        fields = set(RouteProvenance.__dataclass_fields__)
        items = [RouteProvenance(**x) if isinstance(x, dict) and set(x) <= fields else x for x in items]
        try:
            return list(checked_provenance(items, samples))  # type: ignore[arg-type]
        except ProvenanceError as e:
            raise ProvenanceError(f"{what}: {e}") from None

    return ProvenancePairing(column(ROUTE_PROVENANCE_KEY), column(LOGPROB_PROVENANCE_KEY), list(names),
                             samples=samples)


# ------------------------------------------------------------------ what each engine reports of it
def _version_number(value: Any) -> Optional[int]:
    """A weight version as an int: ints, and strings of digits (SGLang's ``weight_version`` is a
    free-form tag, ``"default"`` until a weight update names one); anything else is unknown."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return reported_int(value)


def vllm_provenance(request_output: Any, *, weight_version: Optional[int] = None, engine: str = "vllm",
                    request_id: Optional[str] = None) -> RouteProvenance:
    """Where a vLLM ``RequestOutput``'s routes came from: its ``request_id`` and, as the epoch, the
    number of times the scheduler preempted it (``num_preempted``, on the ``CompletionOutput`` or
    the request where the build reports it: a preempted request is re-prefilled, and vLLM #39917
    drops its routes). vLLM does not know the policy's weight version: pass the framework's.
    ``request_id``: the framework's name of the request, where its output type carries none;
    ``None`` (no output at all) reads as unknown throughout."""
    completion = (getattr(request_output, "outputs", None) or [None])[0]
    preempted = getattr(completion, "num_preempted", None)
    if preempted is None:
        preempted = getattr(request_output, "num_preempted", None)
    if request_id is None:
        request_id = str(getattr(request_output, "request_id", "") or "")
    return RouteProvenance(engine, request_id, weight_version, reported_int(preempted))


def sglang_provenance(meta_info: Mapping[str, Any], *, weight_version: Optional[int] = None,
                      engine: str = "sglang") -> RouteProvenance:
    """Where an SGLang response's routes came from, from its ``meta_info``: ``id`` (the request id),
    ``num_retractions`` (how often the scheduler retracted and re-prefilled it: the epoch; a
    retraction during an async weight update returns the re-prefill's routes with the first
    pass's log-probs, miles #3277) and ``weight_version`` (when it is a number). ``weight_version``
    given here (the framework's own) takes precedence."""
    if not isinstance(meta_info, Mapping):
        raise PayloadError(f"SGLang meta_info must be a dict, got {type(meta_info).__name__}")
    epoch = reported_int(meta_info.get("num_retractions"))
    version = weight_version if weight_version is not None else _version_number(meta_info.get("weight_version"))
    return RouteProvenance(engine, str(meta_info.get("id") or ""), version, epoch)

