"""What a framework hands over -> the routes the trainer reads.

* ``handed``        - ``HandedRoutes``: one micro-batch's routes as the framework hands them over,
                      viewed (no copy, no id read), metadata checked once; the whole-batch form
* ``gather``        - reading rows of those buffers (one gather, or one copy per run of engine rows)
* ``stitching``     - multi-turn / resubmit engine calls -> one sequence per sample, first-seen rows
* ``engine_report`` - engine payloads classified row by row as the reader does (degenerate rows)
* ``masked_fields`` - a routes field over a padded [B, S] batch with its own no-route mask, viewed
* ``sequence_last`` - a sequence-last ``[B, L, K, S]`` field (AReaL's) as ``HandedRoutes``
* ``sglang_attempts`` - one SGLang request's attempts (resubmits) -> first-seen rows, their provenance
* ``forwarding``    - a framework's client wrapped by composition (the rollout side's capture)

The one reader continues in :mod:`r3bridge.parallel` (``rank_rows``, ``read``): one rank's targets.
"""
