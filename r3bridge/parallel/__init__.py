"""Which rank's routers see which token and layer, and the rank distribution of routes.

* ``layout``     - ``ParallelLayout``: TP / SP / CP / PP / VPP / EP, MoE layers per stage
* ``packing``    - ``PackPlan`` (how the trainer pads and packs a micro-batch) and the row maps
* ``sharding``   - ``shard``: one rank's targets of a validated batch (the reader on a ``ReplayBatch``)
* ``unsharding`` - R2, the inverse: every rank's routes back into one per-sample batch
* ``id_words``   - route ids moved as machine words
"""
