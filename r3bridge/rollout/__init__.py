"""The rollout process: an inference engine's calls of each sample -> first-seen routes and their
provenance, before anything reaches the trainer.

* ``stitching``  - the one first-seen rule: multi-turn / resubmit engine calls -> one sequence per
                   sample (``stitch`` on ReplayBatches, ``first_seen_rows`` on raw arrays,
                   ``rollout_routes`` from vLLM payloads)
* ``capture``    - ``StitchedRollout``: a rollout loop's calls of each sample, stitched first-seen
* ``forwarding`` - ``CallRecorder``: the one call recorder, a framework's client wrapped by
                   composition at the adapter's hook point
* ``provenance`` - ``first_seen_provenance``: the one rule for where stitched routes and their
                   log-probs came from, fed by each engine format's reader

What the trainer side reads of it continues in :mod:`r3bridge.forms` (the transport forms) and
:mod:`r3bridge.parallel` (the one reader: ``HandedRoutes`` -> one rank's targets).
"""
