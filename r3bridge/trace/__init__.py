"""Route traces (core: torch only): the on-disk format, reading them back and merging ranks.

The writer is the Megatron driver's (:mod:`r3bridge.megatron.trace`); ``r3bridge inspect`` /
``diff`` (:mod:`r3bridge.cli`) read through this package's names.
"""
from r3bridge.trace.reading import (
    FORMAT_VERSION,
    VIEWS,
    MergedPass,
    Trace,
    TraceError,
    TracePass,
    append_index,
    compare,
    index_name,
    layout_from_json,
    layout_to_json,
    load_trace,
    micro_batch_entry,
    pass_summary,
    payload_name,
    rank_batch,
    token_uid,
    write_payload,
)

__all__ = ["TraceError", "FORMAT_VERSION", "VIEWS", "index_name", "payload_name", "layout_to_json", "layout_from_json",
           "micro_batch_entry", "rank_batch", "write_payload", "append_index", "Trace", "TracePass", "MergedPass",
           "load_trace", "pass_summary", "compare", "token_uid"]
