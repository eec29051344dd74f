"""Route traces (core: torch only), written and read: the names ``r3bridge inspect`` / ``diff`` and the
adapters use.

* ``writing`` - ``RunTracer`` / ``PassTrace``: what a traced pass's routers routed, written by each
                rank at the end of the pass (the session's phase runner owns one when ``trace_dir`` is set)
* ``format``  - the on-disk format (names, index lines, payloads); :func:`token_uid` names samples
* ``reading`` - :func:`load_trace` and merging a pass's ranks back into per-sample batches
* ``compare`` - per-layer summaries of a pass and two passes compared sample by sample
"""
from r3bridge.trace.compare import compare, pass_summary
from r3bridge.trace.format import (
    FORMAT_VERSION,
    VIEWS,
    TraceError,
    append_index,
    index_name,
    layout_from_json,
    layout_to_json,
    micro_batch_entry,
    payload_name,
    rank_batch,
    token_uid,
    write_payload,
)
from r3bridge.trace.reading import MergedPass, Trace, TracePass, load_trace

__all__ = ["TraceError", "FORMAT_VERSION", "VIEWS", "index_name", "payload_name", "layout_to_json", "layout_from_json",
           "micro_batch_entry", "rank_batch", "write_payload", "append_index", "Trace", "TracePass", "MergedPass",
           "load_trace", "pass_summary", "compare", "token_uid"]
