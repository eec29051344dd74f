"""r3bridge: MoE routing replay (R2 / R3) for RL trainers on Megatron.

The core (this package's top level) is pure tensor logic on torch and numpy: the `ReplayBatch`
schema, engine ingest, `ParallelLayout` and the exact rank distribution `shard` / `unshard`.
`r3bridge.megatron` drives megatron-core; `r3bridge.adapters` plug it into trainers.
"""
from r3bridge.batch.dense import NO_ROUTE, dense_routes, padded_routes
from r3bridge.batch.provenance import RouteProvenance
from r3bridge.batch.schema import ReplayBatch, route_dtype
from r3bridge.errors import (
    ConfigError,
    CoverageError,
    LayerMappingError,
    LayoutError,
    PayloadError,
    ProvenanceError,
    ReplayError,
    ReplayMemoryError,
    ReplayStateError,
    RoleError,
    RouteShapeError,
    RouteValueError,
    RouteWeightsError,
    StitchError,
)
from r3bridge.parallel.handed import HandedRoutes
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.packing import PackPlan, rank_positions
from r3bridge.parallel.sharding import rank_targets, shard
from r3bridge.parallel.targets import ShardedTargets
from r3bridge.parallel.unsharding import unshard
from r3bridge.rollout.stitching import StitchReport, stitch

__version__ = "0.1.0"

__all__ = [
    "ReplayBatch", "RouteProvenance", "ParallelLayout", "PackPlan", "ShardedTargets", "shard", "unshard",
    "rank_positions", "rank_targets", "HandedRoutes", "stitch", "StitchReport", "route_dtype", "dense_routes", "padded_routes", "NO_ROUTE",
    "ReplayError", "RouteValueError", "RouteShapeError", "CoverageError", "LayerMappingError",
    "LayoutError", "PayloadError", "StitchError", "ConfigError", "ReplayStateError", "ReplayMemoryError",
    "RoleError", "RouteWeightsError", "ProvenanceError",
]
