"""Route traces (core: torch only), the names ``r3bridge inspect`` / ``diff`` and the adapters use.

* ``format``  - the on-disk format (names, index lines, payloads); what the writer
                (:mod:`r3bridge.megatron.trace`) writes; :func:`token_uid` names samples
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
