"""Routes by reference (issue 47): each sample's routes are written once, where they appear, to a
store (files, in shared memory or on disk, Ray's object store, an external key-value store), the
batch carries a small :class:`RouteHandle`, and each trainer rank reads only its token rows of its
stage's layers, every byte read checked against its digest (docs/route-handles.md). Off by default:
``r3bridge.route_transport: handles`` turns it on.

* ``handle``   - :class:`RouteHandle` (where, shape, dtype, layer axis, start row, run / step, digest)
* ``backends`` - the resolver protocol and the stores: :class:`FileRoutes`, :class:`RayRoutes`,
  :class:`KeyValueRoutes` (the plug point for external stores)
* ``store``    - :class:`RouteStore`: the writer, and the lifetime (released per RL step)
* ``read``     - :func:`handed_routes` (a micro-batch's handles as the one reader's ``HandedRoutes``: what an
  adapter hands the driver), :func:`read_rank_targets` (one micro-batch, one rank), :func:`resolve` (one handle)
"""
from r3bridge.handles.backends import (
    FileRoutes,
    KeyValueRoutes,
    KeyValueStore,
    LocalKeyValue,
    OpenRoutes,
    RayRoutes,
    RouteBackend,
    RouteResolver,
)
from r3bridge.handles.handle import DEFAULT_BLOCK_ROWS, RouteHandle, RouteHandleError
from r3bridge.handles.read import HandleReads, handed_routes, read_rank_targets, resolve
from r3bridge.handles.store import RouteStore, SampleRoutes

__all__ = ["RouteHandle", "RouteHandleError", "DEFAULT_BLOCK_ROWS", "RouteResolver", "RouteBackend", "OpenRoutes",
           "FileRoutes", "RayRoutes", "KeyValueRoutes", "KeyValueStore", "LocalKeyValue", "RouteStore", "SampleRoutes",
           "HandleReads", "handed_routes", "read_rank_targets", "resolve"]
