"""What a framework hands over -> the routes the trainer reads.

* ``handed``        - ``HandedRoutes``: one micro-batch's routes as the framework hands them over,
                      viewed (no copy, no id read), metadata checked once; the whole-batch form
* ``gather``        - reading rows of those buffers (one gather, or one copy per run of engine rows)
* ``masked_fields`` - a routes field over a padded [B, S] batch with its own no-route mask, viewed
* ``sequence_last`` - a sequence-last ``[B, L, K, S]`` field as ``HandedRoutes``

The rollout process's side (engine calls, first-seen stitching, provenance) is :mod:`r3bridge.rollout`;
the one reader continues in :mod:`r3bridge.parallel` (``rank_rows``, ``read``): one rank's targets.
"""
