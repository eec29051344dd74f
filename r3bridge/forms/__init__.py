"""Transport forms two or more adapters hand over: one module per form, read and written together.

* ``masked`` - a routes field over a padded ``[B, S]`` batch with its own no-route mask (packed
               ``(values, cu_seqlens)`` or padded ``[B, S, L, K]``): viewed for the one reader,
               and a ``ReplayBatch`` written back in the same form
* ``codec``  - ``HandedCodec``: a codec's shared half (the model's shape; ``to_replay_batch`` by
               the reader's rules from the codec's ``handed_routes``)

A form only one framework uses lives in that framework's adapter. Every form is read into
:class:`r3bridge.parallel.handed.HandedRoutes`, the start of the one reader in :mod:`r3bridge.parallel`.
"""
