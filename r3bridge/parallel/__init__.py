"""Which rank's routers see which token and layer, and one rank's targets of a micro-batch.

* ``layout``     - ``ParallelLayout``: TP / SP / CP / PP / VPP / EP, MoE layers per stage
* ``packing``    - ``PackPlan`` (how the trainer pads and packs a micro-batch) and the row maps
* ``rank_rows``  - ``RankRows``: the pack plan and this rank's row map, once per micro-batch
* ``read``       - ``read_targets``: gather, check where the targets go, fillers, int64
* ``targets``    - ``ShardedTargets``: what the driver installs
* ``sharding``   - the reader's public entries: ``shard`` (a ``ReplayBatch``), ``rank_targets`` (vLLM arrays)
* ``unsharding`` - R2, the inverse: every rank's routes back into one per-sample batch
* ``id_words``   - route ids moved as machine words
"""
