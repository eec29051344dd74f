"""Every problem with replay input or configuration raises a subclass of :class:`ReplayError`.

Messages name *where* the problem is (sequence, row, layer, rank) so that a user can find the
offending sample in a batch of thousands.
"""
from __future__ import annotations


class ReplayError(Exception):
    """Base class of every r3bridge error."""


class RouteValueError(ReplayError):
    """An expert id is out of range or duplicated within a row."""


class RouteShapeError(ReplayError):
    """Routes have the wrong rank, top-k, layer count or dtype."""


class CoverageError(ReplayError):
    """Rows do not fit the sequence they claim to cover (start row / row count / seq_len)."""


class LayerMappingError(ReplayError):
    """Layer ids are duplicated, missing for a pipeline stage, or inconsistent with the model."""


class LayoutError(ReplayError):
    """The parallel layout is impossible (e.g. SP with tp == 1, vpp with pp == 1)."""


class PayloadError(ReplayError):
    """A serialized payload (SGLang base64, r3bridge bytes) is malformed or truncated."""


class RouteWeightsError(ReplayError):
    """Routing weights do not fit their routes (shape) or are not finite non-negative numbers."""


class StitchError(ReplayError):
    """Multi-turn / resubmit routes cannot be stitched unambiguously."""


class ConfigError(ReplayError):
    """A framework or Megatron configuration makes exact replay impossible."""


class ReplayStateError(ReplayError):
    """Replay state was used out of order: missing target, consumed twice, leaked across passes."""


class ReplayMemoryError(ReplayError, MemoryError):
    """A batch does not fit in this host's memory; the message names the sizes (rows, layers,
    top-k, bytes) and the way around it (build only one rank's targets:
    :func:`r3bridge.rank_targets`)."""


class RoleError(ReplayError):
    """A model of one role (critic, reference, teacher, draft / MTP) would replay, received another
    role's routes, or had its replay state changed by another role's build: only the actor
    replays. The message names both roles."""


class ProvenanceError(ReplayError):
    """Route provenance is malformed (wrong length, wrong type), or the routes of a sample came
    from another engine pass than the log-probs they are paired with (``provenance_check="refuse"``)."""


class DegenerateRouteError(RouteValueError):
    """Inside the rows an engine returned for a sample, a row whose expert ids repeat (vLLM #54730:
    every id 0): a broken capture, not a missing route. Refused by default
    (``ReplayConfig.degenerate_routes``); the message names sample, row, token and layer."""
