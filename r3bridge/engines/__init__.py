"""Engine payloads -> checked route-id arrays, before any batch exists: the bottom of the core.

* ``decoders``        - vLLM / SGLang / TensorRT-LLM payloads and padded trainer fields -> integer arrays
* ``route_formats``   - every shipped route format by engine release (one table), raw route bytes
* ``layer_axis``      - what an engine's layer axis holds (every hidden layer or the MoE ones), stated
* ``layer_ids``       - the 0-based layer-id convention, dense columns, the 1-based hint
* ``engine_pack``     - per-sequence engine arrays -> one buffer in the schema dtype, in one sweep
* ``route_scan``      - range and distinct-within-row of id blocks, fused with that copy (host)
* ``engine_settings`` - engine settings that make R3's routes wrong (speculative decoding, KV transfer)

:mod:`r3bridge.batch` builds ``ReplayBatch`` on these; the one reader (:mod:`r3bridge.parallel`)
checks what a framework hands over with them.
"""
