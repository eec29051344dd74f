"""What a framework hands over -> the routes the trainer reads.

* ``stitching``     - multi-turn / resubmit engine calls -> one sequence per sample, first-seen rows
* ``engine_report`` - engine payloads classified row by row as the reader does (degenerate rows)
* ``sglang_attempts`` - one SGLang request's attempts (resubmits) -> first-seen rows, their provenance
* ``forwarding``    - a framework's client wrapped by composition (the rollout side's capture)

The one reader (``HandedRoutes`` -> one rank's targets) is :mod:`r3bridge.parallel`; transport forms
shared by adapters are :mod:`r3bridge.forms`.
"""
