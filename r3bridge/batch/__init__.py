"""``ReplayBatch``: the routes of a batch of sequences in one explicit, compact schema.

* ``schema``        - ``ReplayBatch`` and its constructors (ragged, packed, padded, vLLM, SGLang, TRT-LLM)
* ``meta``          - metadata checks (row counts, layer ids, top-k, start rows, coverage) before any id
* ``route_weights`` - the engine's gate weight of each routed id (optional, float16)
* ``provenance``    - where each sequence's routes came from, and the pairing check with its log-probs
* ``wire``          - the bytes: versioned header, raw buffers, CRCs (no import of ``schema``)
* ``canonical``     - the canonical trainer-side form every adapter produces, and its small edits
* ``dense``         - a batch back in a framework's dense per-sample layout ("no route" explicit)

Built on :mod:`r3bridge.engines`; transport forms in :mod:`r3bridge.forms`; read to ranks by :mod:`r3bridge.parallel`.
"""
