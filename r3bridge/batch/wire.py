"""The wire format of a `ReplayBatch`: versioned header, raw little-endian buffers, two CRC32s.

This module knows bytes, not the schema: :func:`encode` reads a batch's fields (duck-typed, so
no import of :mod:`r3bridge.batch.schema` and no cycle), :func:`decode` returns the fields as plain
values; ``ReplayBatch.from_bytes`` rebuilds (and re-validates) the batch from them.

Header (little endian):
  magic b"R3RB" | version u16 | dtype code u8 | flags u8 (bit0: policy_versions present,
  bit1: provenance present, bit2: routing weights present)
  num_seqs u32 | total_rows u64 | num_layers u32 | topk u32 | num_experts u32 | label_len u16
  | header crc32 u32 (over the header bytes before it)
then the body: route label utf-8 | layer_ids i32[L] | rows_per_seq i64[n] | start_rows i64[n]
      | [policy_versions i64[n]] | [provenance] | valid packed bits u8[ceil(rows/8)] | routes raw
      | [weights f16[rows, L, K], little endian]  (bit2; the last section, after the routes)
and last: body crc32 u32 (over the body).

The route label is one word for what the routes are (:func:`r3bridge.batch.provenance.route_label`:
the engine's name for rollout routes that name one, else the route kind): the field every version
wrote, read back into ``route_kind`` and ``engine`` by ``ReplayBatch.from_bytes``.

Provenance (flags bit1; :mod:`r3bridge.batch.provenance`), one entry per sequence, columns:
  weight_version i64[n] (-1: unknown) | epoch i32[n] (-1: unknown) | attempt i32[n] (-1: unknown;
  version 4 on) | engine length u16[n] | request id length u32[n] | the engines' utf-8 bytes
  | the request ids' utf-8 bytes
An engine length of 0 marks a sequence without provenance (a provenance always names its engine).
Older payloads are read as they were written: version 3 has no attempt column (attempts unknown),
version 2 no provenance and no weights (only bit0).

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

from r3bridge.batch.provenance import RouteProvenance, route_label
from r3bridge.errors import PayloadError, ProvenanceError

__all__ = ["encode", "decode", "encoded_size", "DecodedBatch", "VERSION"]

MAGIC = b"R3RB"
VERSION = 4
# 2: before provenance and weights (flags bit1 and bit2 never set); 3: provenance without attempts
READABLE_VERSIONS = (2, 3, 4)
FLAG_POLICY_VERSIONS = 1
FLAG_PROVENANCE = 2
FLAG_WEIGHTS = 4
_KNOWN_FLAGS = FLAG_POLICY_VERSIONS | FLAG_PROVENANCE | FLAG_WEIGHTS
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
    label: str                      # route_label(route_kind, engine)
    policy_versions: list[int] | None
    provenance: tuple[RouteProvenance | None, ...] | None = None
    weights: torch.Tensor | None = None     # float16 [rows, L, K] (flags bit2)


# ---------------------------------------------------------------- routing weights (flags bit2)
_WEIGHTS_NP = np.dtype("<f2")


def _weights_flag(rb: Any) -> int:
    return FLAG_WEIGHTS if getattr(rb, "weights", None) is not None else 0


def _weights_size(flags: int, rows: int, nl: int, k: int) -> int:
    return 2 * rows * nl * k if flags & FLAG_WEIGHTS else 0


def _encode_weights(rb: Any) -> list[bytes]:
    """The weights section (empty list without weights): float16 little endian, row-major."""
    if getattr(rb, "weights", None) is None:
        return []
    w = rb.weights.detach().cpu().contiguous().to(torch.float16).numpy()
    return [w.astype(_WEIGHTS_NP, copy=False).tobytes()]


def _decode_weights(section: memoryview, flags: int, rows: int, nl: int, k: int) -> torch.Tensor | None:
    if not flags & FLAG_WEIGHTS:
        return None
    w = np.frombuffer(section, dtype=_WEIGHTS_NP).reshape(rows, nl, k)
    return torch.from_numpy(w.astype(np.float16, copy=True))


def encoded_size(rb: Any) -> int:
    """``len(encode(rb))`` without building it."""
    n, rows = rb.num_seqs, rb.total_rows
    return (_HEADER.size + len(route_label(rb.route_kind, rb.engine).encode()) + 4 * rb.num_layers + 16 * n
            + (8 * n if rb.policy_versions is not None else 0) + _provenance_size(rb.provenance) + (rows + 7) // 8
            + rb.routes.numel() * rb.routes.element_size()
            + _weights_size(_weights_flag(rb), rows, rb.num_layers, rb.topk) + _CRC.size)


def encode(rb: Any) -> bytes:
    """A `ReplayBatch` -> payload bytes."""
    src = route_label(rb.route_kind, rb.engine).encode()
    flags = (FLAG_POLICY_VERSIONS if rb.policy_versions is not None else 0) | \
        (FLAG_PROVENANCE if rb.provenance is not None else 0) | _weights_flag(rb)
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
    if rb.provenance is not None:
        body.append(_encode_provenance(rb.provenance))
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
    if version not in READABLE_VERSIONS:
        hint = " (written before payloads carried checksums: re-encode it)" if version == 1 else ""
        raise PayloadError(f"ReplayBatch payload version {version}{hint}; this r3bridge reads versions "
                           f"{', '.join(map(str, READABLE_VERSIONS))}")
    if zlib.crc32(memoryview(data)[:_HEADER_FIELDS.size]) != head_crc:
        raise PayloadError("ReplayBatch payload header checksum mismatch: the header is corrupted")
    known = _KNOWN_FLAGS if version >= 3 else FLAG_POLICY_VERSIONS
    if flags & ~known:
        raise PayloadError(f"ReplayBatch payload version {version} has unknown flags {flags:#04x} "
                           f"(written by a newer r3bridge?)")
    if code not in _CODE_DTYPES:
        raise PayloadError(f"ReplayBatch payload has unknown dtype code {code}")
    dtype = _CODE_DTYPES[code]
    sizes = [src_len, 4 * nl, 8 * n, 8 * n, 8 * n if flags & FLAG_POLICY_VERSIONS else 0]
    # the provenance section's size is in its own length columns (covered by the body CRC below)
    sizes.append(_provenance_section_size(data, _HEADER.size + sum(sizes), n, version)
                 if flags & FLAG_PROVENANCE else 0)
    sizes += [(rows + 7) // 8, rows * nl * k * torch.empty((), dtype=dtype).element_size(),
              _weights_size(flags, rows, nl, k)]
    need = _HEADER.size + sum(sizes) + _CRC.size
    if len(data) != need:
        raise PayloadError(
            f"ReplayBatch payload is {len(data)} bytes but its header (seqs={n}, rows={rows}, "
            f"layers={nl}, topk={k}) needs {need}: truncated or extended")
    body = memoryview(data)[_HEADER.size:need - _CRC.size]
    if zlib.crc32(body) != _CRC.unpack_from(data, need - _CRC.size)[0]:
        raise PayloadError("ReplayBatch payload body checksum mismatch: routes or metadata are corrupted")
    pos = 0
    sections = []
    for s in sizes:
        sections.append(body[pos:pos + s])
        pos += s
    try:
        label = bytes(sections[0]).decode()
    except UnicodeDecodeError:
        raise PayloadError("ReplayBatch payload: route label is not UTF-8: corrupted") from None
    valid = np.unpackbits(np.frombuffer(sections[6], dtype=np.uint8), count=rows, bitorder="little").astype(bool)
    routes = np.frombuffer(sections[7], dtype=np.dtype(_NP[dtype]).newbyteorder("<")).reshape(rows, nl, k)
    return DecodedBatch(
        routes=torch.from_numpy(routes.astype(_NP[dtype], copy=True)),
        valid=torch.from_numpy(valid.copy()),
        rows_per_seq=np.frombuffer(sections[2], dtype="<i8").tolist(),
        start_rows=np.frombuffer(sections[3], dtype="<i8").tolist(),
        layer_ids=np.frombuffer(sections[1], dtype="<i4").tolist(),
        num_experts=e, label=label,
        policy_versions=np.frombuffer(sections[4], dtype="<i8").tolist() if flags & FLAG_POLICY_VERSIONS else None,
        provenance=_decode_provenance(sections[5], n, version) if flags & FLAG_PROVENANCE else None,
        weights=_decode_weights(sections[8], flags, rows, nl, k))


# ------------------------------------------------------------------------------- provenance section
_ABSENT = -1                      # weight version / epoch / attempt unknown


def _prov_fixed(version: int) -> int:
    """Bytes per sequence before the strings: version, epoch, (attempt,) two lengths."""
    return 8 + 4 + (4 if version >= 4 else 0) + 2 + 4


def _provenance_size(provenance) -> int:
    if provenance is None:
        return 0
    return _prov_fixed(VERSION) * len(provenance) + sum(
        len(p.engine.encode()) + len(p.request_id.encode()) for p in provenance if p is not None)


def _encode_provenance(provenance) -> bytes:
    """The section's bytes: five columns, then the engines' and the request ids' utf-8 bytes."""
    n = len(provenance)
    versions = np.full(n, _ABSENT, dtype="<i8")
    epochs = np.full(n, _ABSENT, dtype="<i4")
    attempts = np.full(n, _ABSENT, dtype="<i4")
    engine_lens = np.zeros(n, dtype="<u2")
    request_lens = np.zeros(n, dtype="<u4")
    engines, requests = [], []
    for i, p in enumerate(provenance):
        if p is None:
            continue
        engine, request = p.engine.encode(), p.request_id.encode()
        if len(engine) > 0xFFFF or len(request) > 0xFFFFFFFF:
            raise PayloadError(f"sequence {i}: provenance engine name of {len(engine)} bytes does not fit the "
                               f"wire format (at most 65535)")
        versions[i] = _ABSENT if p.weight_version is None else p.weight_version
        epochs[i] = _ABSENT if p.epoch is None else p.epoch
        attempts[i] = _ABSENT if p.attempt is None else p.attempt
        engine_lens[i], request_lens[i] = len(engine), len(request)
        engines.append(engine)
        requests.append(request)
    return b"".join([versions.tobytes(), epochs.tobytes(), attempts.tobytes(), engine_lens.tobytes(),
                     request_lens.tobytes(), *engines, *requests])


def _provenance_section_size(data: bytes, start: int, n: int, version: int) -> int:
    """Size of the section at ``start`` of ``data``, read from its length columns."""
    fixed = _prov_fixed(version)
    if len(data) < start + fixed * n:
        raise PayloadError(f"ReplayBatch payload truncated inside its provenance section ({len(data)} bytes)")
    lens_at = start + (fixed - 6) * n
    engine_lens = np.frombuffer(data, dtype="<u2", count=n, offset=lens_at)
    request_lens = np.frombuffer(data, dtype="<u4", count=n, offset=lens_at + 2 * n)
    return fixed * n + int(engine_lens.sum(dtype=np.int64)) + int(request_lens.sum(dtype=np.int64))


def _decode_provenance(section: memoryview, n: int, version: int) -> tuple[RouteProvenance | None, ...]:
    fixed = _prov_fixed(version)
    versions = np.frombuffer(section, dtype="<i8", count=n).tolist()
    epochs = np.frombuffer(section, dtype="<i4", count=n, offset=8 * n).tolist()
    # version 3 has no attempt column: every attempt unknown
    attempts = (np.frombuffer(section, dtype="<i4", count=n, offset=12 * n).tolist() if version >= 4
                else [_ABSENT] * n)
    engine_lens = np.frombuffer(section, dtype="<u2", count=n, offset=(fixed - 6) * n).tolist()
    request_lens = np.frombuffer(section, dtype="<u4", count=n, offset=(fixed - 4) * n).tolist()
    pos = fixed * n
    engines = []
    for length in engine_lens:
        engines.append(bytes(section[pos:pos + length]))
        pos += length
    out: list[RouteProvenance | None] = []
    for i in range(n):
        request = bytes(section[pos:pos + request_lens[i]])
        pos += request_lens[i]
        if not engine_lens[i]:
            out.append(None)
            continue
        try:
            out.append(RouteProvenance(engines[i].decode(), request.decode(),
                                       None if versions[i] == _ABSENT else versions[i],
                                       None if epochs[i] == _ABSENT else epochs[i],
                                       None if attempts[i] == _ABSENT else attempts[i]))
        except (UnicodeDecodeError, ProvenanceError) as e:
            raise PayloadError(f"ReplayBatch payload: sequence {i}'s provenance is malformed ({e})") from None
    return tuple(out)
