"""Which rank's routers see which token and layer, and the one reader: what a framework hands over
for one micro-batch -> one rank's targets.

* ``layout``     - ``ParallelLayout``: TP / SP / CP / PP / VPP / EP, MoE layers per stage
* ``packing``    - ``PackPlan`` (how the trainer pads and packs a micro-batch) and the row maps
* ``handed``     - ``HandedRoutes``: one micro-batch's routes as the framework hands them over,
                 viewed (no copy, no id read), metadata checked once; the whole-batch form
* ``gather``     - reading rows of those buffers (one gather, or one copy per run of engine rows)
* ``rank_rows``  - ``RankRows``: the pack plan and this rank's row map, once per micro-batch
* ``read``       - ``read_targets``: gather, check where the targets go, fillers, int64
* ``targets``    - ``ShardedTargets``: what the driver installs
* ``sharding``   - the reader's public entries: ``shard`` (a ``ReplayBatch``), ``rank_targets`` (vLLM arrays)
* ``unsharding`` - R2, the inverse: every rank's routes back into one per-sample batch
* ``id_words``   - route ids moved as machine words
"""
