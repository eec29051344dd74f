"""The wire format of a `ReplayBatch`: versioned header, raw little-endian buffers, two CRC32s.

This module knows bytes, not the schema: :func:`encode` reads a batch's fields (duck-typed, so
no import of :mod:`r3bridge.schema` and no cycle), :func:`decode` returns the fields as plain
values; ``ReplayBatch.from_bytes`` rebuilds (and re-validates) the batch from them.

Header (little endian):
  magic b"R3RB" | version u16 | dtype code u8 | flags u8 (bit0: policy_versions present,
  bit2: routing weights present)
  num_seqs u32 | total_rows u64 | num_layers u32 | topk u32 | num_experts u32 | source_len u16
  | header crc32 u32 (over the header bytes before it)
then the body: source utf-8 | layer_ids i32[L] | rows_per_seq i64[n] | start_rows i64[n]
      | [policy_versions i64[n]] | valid packed bits u8[ceil(rows/8)] | routes raw
      | [weights f16[rows, L, K], little endian]  (bit2; the last section, so a payload without it
        reads as before)
and last: body crc32 u32 (over the body).

The two CRC32s exist because re-validation alone cannot see most damage: a flipped byte in
num_experts, a layer id, a start row, an expert id or the validity bits still decodes into a
well-formed but different batch. CRC32 detects every error burst up to 32 bits, so every
single-byte flip. The header has its own checksum so the sizes it declares are trusted before
they are used to slice the body.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from r3bridge.errors import PayloadError

__all__ = ["encode", "decode", "encoded_size", "DecodedBatch", "VERSION"]

MAGIC = b"R3RB"
VERSION = 2
_HEADER_FIELDS = struct.Struct("<4sHBBIQIIIH")
_HEADER = struct.Struct("<4sHBBIQIIIHI")
_CRC = struct.Struct("<I")
_DTYPE_CODES = {torch.uint8: 1, torch.int16: 2, torch.int32: 3}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
_NP = {torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32}


@dataclass(frozen=True)
class DecodedBatch:
    """The fields of a payload, checksums verified, values not yet validated."""

    routes: torch.Tensor
    valid: torch.Tensor
    rows_per_seq: list[int]
    start_rows: list[int]
    layer_ids: list[int]
    num_experts: int
    source: str
    policy_versions: list[int] | None
    weights: torch.Tensor | None = None     # float16 [rows, L, K] (flags bit2)


# ---------------------------------------------------------------- routing weights (flags bit2)
WEIGHTS_FLAG = 4
_WEIGHTS_NP = np.dtype("<f2")


def _weights_flag(rb: Any) -> int:
    return WEIGHTS_FLAG if getattr(rb, "weights", None) is not None else 0


def _weights_size(flags: int, rows: int, nl: int, k: int) -> int:
    return 2 * rows * nl * k if flags & WEIGHTS_FLAG else 0


def _encode_weights(rb: Any) -> list[bytes]:
    """The weights section (empty list without weights): float16 little endian, row-major."""
    if getattr(rb, "weights", None) is None:
        return []
    w = rb.weights.detach().cpu().contiguous().to(torch.float16).numpy()
    return [w.astype(_WEIGHTS_NP, copy=False).tobytes()]


def _decode_weights(chunk: memoryview, flags: int, rows: int, nl: int, k: int) -> torch.Tensor | None:
    if not flags & WEIGHTS_FLAG:
        return None
    w = np.frombuffer(chunk, dtype=_WEIGHTS_NP).reshape(rows, nl, k)
    return torch.from_numpy(w.astype(np.float16, copy=True))


def encoded_size(rb: Any) -> int:
    """``len(encode(rb))`` without building it."""
    n, rows = rb.num_seqs, rb.total_rows
    return (_HEADER.size + len(rb.source.encode()) + 4 * rb.num_layers + 16 * n
            + (8 * n if rb.policy_versions is not None else 0) + (rows + 7) // 8
            + rb.routes.numel() * rb.routes.element_size()
            + _weights_size(_weights_flag(rb), rows, rb.num_layers, rb.topk) + _CRC.size)


def encode(rb: Any) -> bytes:
    """A `ReplayBatch` -> payload bytes."""
    src = rb.source.encode()
    flags = (1 if rb.policy_versions is not None else 0) | _weights_flag(rb)
    fields = _HEADER_FIELDS.pack(MAGIC, VERSION, _DTYPE_CODES[rb.routes.dtype], flags, rb.num_seqs,
                                 rb.total_rows, rb.num_layers, rb.topk, rb.num_experts, len(src))
    body = [
        src,
        np.asarray(rb.layer_ids, dtype="<i4").tobytes(),
        np.asarray(rb.rows_per_seq, dtype="<i8").tobytes(),
        np.asarray(rb.start_rows, dtype="<i8").tobytes(),
    ]
    if rb.policy_versions is not None:
        body.append(np.asarray(rb.policy_versions, dtype="<i8").tobytes())
    body.append(np.packbits(rb.valid.cpu().numpy(), bitorder="little").tobytes())
    body.append(rb.routes.cpu().contiguous().numpy().astype(np.dtype(_NP[rb.routes.dtype]).newbyteorder("<"),
                                                            copy=False).tobytes())
    body += _encode_weights(rb)
    crc = 0
    for part in body:
        crc = zlib.crc32(part, crc)
    return b"".join([fields, _CRC.pack(zlib.crc32(fields)), *body, _CRC.pack(crc)])


def decode(data: bytes) -> DecodedBatch:
    """Payload bytes -> fields; raises :class:`PayloadError` on any damage the format can see."""
    if len(data) < _HEADER.size:
        raise PayloadError(f"ReplayBatch payload truncated: {len(data)} bytes, header needs {_HEADER.size}")
    magic, version, code, flags, n, rows, nl, k, e, src_len, head_crc = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise PayloadError(f"not a ReplayBatch payload (magic {magic!r})")
    if version != VERSION:
        hint = " (written before payloads carried checksums: re-encode it)" if version == 1 else ""
        raise PayloadError(f"ReplayBatch payload version {version}{hint}; this r3bridge reads version {VERSION}")
    if zlib.crc32(memoryview(data)[:_HEADER_FIELDS.size]) != head_crc:
        raise PayloadError("ReplayBatch payload header checksum mismatch: the header is corrupted")
    if code not in _CODE_DTYPES:
        raise PayloadError(f"ReplayBatch payload has unknown dtype code {code}")
    dtype = _CODE_DTYPES[code]
    sizes = [src_len, 4 * nl, 8 * n, 8 * n, 8 * n if flags & 1 else 0, (rows + 7) // 8,
             rows * nl * k * torch.empty((), dtype=dtype).element_size(), _weights_size(flags, rows, nl, k)]
    need = _HEADER.size + sum(sizes) + _CRC.size
    if len(data) != need:
        raise PayloadError(
            f"ReplayBatch payload is {len(data)} bytes but its header (seqs={n}, rows={rows}, "
            f"layers={nl}, topk={k}) needs {need}: truncated or extended")
    body = memoryview(data)[_HEADER.size:need - _CRC.size]
    if zlib.crc32(body) != _CRC.unpack_from(data, need - _CRC.size)[0]:
        raise PayloadError("ReplayBatch payload body checksum mismatch: routes or metadata are corrupted")
    pos = 0
    chunks = []
    for s in sizes:
        chunks.append(body[pos:pos + s])
        pos += s
    try:
        source = bytes(chunks[0]).decode()
    except UnicodeDecodeError:
        raise PayloadError("ReplayBatch payload: source field is not UTF-8: corrupted") from None
    valid = np.unpackbits(np.frombuffer(chunks[5], dtype=np.uint8), count=rows, bitorder="little").astype(bool)
    routes = np.frombuffer(chunks[6], dtype=np.dtype(_NP[dtype]).newbyteorder("<")).reshape(rows, nl, k)
    return DecodedBatch(
        routes=torch.from_numpy(routes.astype(_NP[dtype], copy=True)),
        valid=torch.from_numpy(valid.copy()),
        rows_per_seq=np.frombuffer(chunks[2], dtype="<i8").tolist(),
        start_rows=np.frombuffer(chunks[3], dtype="<i8").tolist(),
        layer_ids=np.frombuffer(chunks[1], dtype="<i4").tolist(),
        num_experts=e, source=source,
        policy_versions=np.frombuffer(chunks[4], dtype="<i8").tolist() if flags & 1 else None,
        weights=_decode_weights(chunks[7], flags, rows, nl, k))
