"""What a framework hands over -> the routes the trainer reads.

* ``reader``    - the one reader: one micro-batch's handed routes -> one rank's router targets
* ``stitching`` - multi-turn / resubmit engine calls -> one sequence per sample, first-seen rows
"""
