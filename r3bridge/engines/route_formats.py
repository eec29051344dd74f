"""Every route format the engines ship, one decoder each, chosen by the engine's release and the
payload's own fields; an unknown or mismatched format is refused with one message naming the
engine, its release and what was expected.

:data:`ROUTE_FORMATS` is the one table (engine, releases, decoder). Read from the engines' source
and docs (field notes 6, 15, 16; fixtures in ``tests/fixtures/engine_formats/`` say how each was
built):

* ``vllm-split-int16`` (vLLM 0.21): ``prompt_routed_experts`` ``[prompt_len, moe_layers, K]`` plus the
  choice's ``routed_experts`` ``[generated - 1, moe_layers, K]``, int16, JSON lists, MoE layers only.
* ``vllm-array`` (vLLM 0.22-0.30): one ``CompletionOutput.routed_experts`` ``[tokens - 1 - start,
  num_hidden_layers, K]``, uint8 up to 256 experts else uint16 (0.24-0.26 read; int32 on older
  builds), dense layers as zero rows; over HTTP base64 of a ``.npy`` file.
* ``vllm-auxoutput`` (vLLM 0.31+, #45635): the scheduler hands each step's accepted rows as
  ``(token_start, rows)`` with ``token_start = max(routed_experts_prompt_start, tokens - 1)`` once
  decoding started (``AuxOutputRequestOutput``); the rows are kept as KV-block-hash-keyed blocks
  (keys ``vllm-artifact/<namespace>/<block hash hex>``) that a store concatenates into
  ``[-1, num_hidden_layers, K]`` (``materialize_routed_experts``). By value: the emissions (or
  their concatenation) are stitched here, each one starting where the last ended. By reference
  (the Mooncake backend, #57968: keys only): read through a ``resolve`` callable (keys -> the
  concatenated block bytes), refused without one.
* ``sglang-int32`` (SGLang before 0.5.11): ``meta_info["routed_experts"]`` base64 of flat int32
  ``[tokens - 1 - start, num_hidden_layers, K]`` (the detokenizer encodes it), or the raw tensor
  in-process with ``skip_tokenizer_init``.
* ``sglang-int32-base64`` (SGLang 0.5.11+): always base64 (the tokenizer manager encodes the
  ``skip_tokenizer_init`` path too); a client that base64-encodes that string again (dynamo
  #10543) hands over base64 text inside base64: refused, never decoded twice.
* ``sglang-wire-dtype`` (SGLang #31219, unreleased): ``meta_info["routed_experts_dtype"]`` names
  the wire dtype (``int32`` / ``uint16`` / ``uint8``) of the base64 payload; read whenever the key
  is present.

:func:`decode_raw_routes` is the library decoder for raw route bytes: (tokens, layer axis, K)
checked, so a MoE-only payload is never reinterpreted as an every-layer one (or the other way)
because its byte count happens to divide.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from r3bridge.engines.decoders import decode_sglang_routes, decode_vllm_routes
from r3bridge.engines.layer_axis import ALL_HIDDEN, MOE_ONLY, check_layer_axis
from r3bridge.errors import CoverageError, PayloadError, RouteShapeError

__all__ = ["RouteFormat", "EngineRoutes", "ROUTE_FORMATS", "route_format", "decode_engine_routes",
           "decode_raw_routes", "vllm_needs_format", "AUX_OUTPUT_KEY_PREFIX", "SGLANG_WIRE_DTYPE_KEY", "SGLANG_WIRE_DTYPES"]

AUX_OUTPUT_KEY_PREFIX = "vllm-artifact/"          # vLLM AuxOutput store keys (routed_experts_keys)
SGLANG_WIRE_DTYPE_KEY = "routed_experts_dtype"    # SGLang #31219: meta_info names the wire dtype
SGLANG_WIRE_DTYPES = {"int32": "<i4", "uint16": "<u2", "uint8": "u1"}
_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


@dataclass(frozen=True)
class EngineRoutes:
    """One request's decoded routes: ``routes`` ``[rows, layers, K]``, what its layer axis holds,
    the token its first row belongs to, and the format it was read as."""

    routes: np.ndarray
    layer_axis: str
    start_row: int
    format: str


@dataclass(frozen=True)
class RouteFormat:
    """One shipped format: the engine, the releases that ship it (a PEP 440 specifier), the
    decoder, what its layer axis holds, and the words for what it expects."""

    engine: str
    releases: str
    name: str
    layer_axis: str
    expects: str
    decode: Callable[..., EngineRoutes]

    def covers(self, version: Version) -> bool:
        return SpecifierSet(self.releases).contains(version, prereleases=True)


class _Refusal(Exception):
    """A decoder's reason; :func:`decode_engine_routes` turns it into the one message."""


# ----------------------------------------------------------------------------------- raw bytes
def decode_raw_routes(data: Any, *, dtype: Any, tokens: int, topk: int, layer_axis: str,
                      num_hidden_layers: Optional[int] = None, moe_layer_ids: Optional[Sequence[int]] = None,
                      start_row: int = 0, seq: int = 0) -> np.ndarray:
    """Raw route bytes (``bytes`` / ``memoryview`` / a uint8 array) of ``dtype`` -> ``[rows, layers,
    K]`` with every dimension checked: rows = ``tokens - 1 - start_row`` (the last token was never
    fed forward), layers = ``num_hidden_layers`` for ``layer_axis="all_hidden"`` or
    ``len(moe_layer_ids)`` for ``"moe_only"``, ``K`` = ``topk``. A byte count that another reading
    would fit (the other layer axis, one row more or less) is named in the refusal: a bare
    ``frombuffer(...).reshape(-1, L, K)`` would have accepted it silently."""
    axis = check_layer_axis(layer_axis, where="decode_raw_routes(layer_axis=...)")
    if axis is None:
        raise RouteShapeError(f"sequence {seq}: raw route bytes need layer_axis ('all_hidden' or 'moe_only'): "
                              f"their length cannot say which")
    dt = np.dtype(dtype)
    if dt.kind not in "iu":
        raise RouteShapeError(f"sequence {seq}: raw route bytes must hold integers, dtype {dt} given")
    moe = None if moe_layer_ids is None else [int(i) for i in moe_layer_ids]
    if axis == ALL_HIDDEN and num_hidden_layers is None:
        raise RouteShapeError(f"sequence {seq}: layer_axis='all_hidden' needs num_hidden_layers")
    if axis == MOE_ONLY and moe is None:
        raise RouteShapeError(f"sequence {seq}: layer_axis='moe_only' needs moe_layer_ids")
    layers = int(num_hidden_layers) if axis == ALL_HIDDEN else len(moe)
    rows = int(tokens) - 1 - int(start_row)
    if rows < 0 or topk < 1 or layers < 1:
        raise CoverageError(f"sequence {seq}: {tokens} tokens from start row {start_row} with {layers} layers x "
                            f"top-{topk} hold no routes")
    raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    per_row = layers * int(topk) * dt.itemsize
    if len(raw) != rows * per_row:
        raise PayloadError(f"sequence {seq}: {len(raw)} route bytes, expected {rows} rows (tokens {tokens} - 1 - "
                           f"start {start_row}) x {layers} layers ({axis}) x top-{topk} x {dt.itemsize} B = "
                           f"{rows * per_row}{_other_reading(len(raw), rows, layers, int(topk), dt, axis, num_hidden_layers, moe)}")
    return np.frombuffer(raw, dtype=dt).reshape(rows, layers, int(topk))


def _other_reading(nbytes: int, rows: int, layers: int, topk: int, dt: np.dtype, axis: str,
                   hidden: Optional[int], moe: Optional[list[int]]) -> str:
    """Which other reading the byte count fits, so the refusal names the likely mix-up."""
    other_layers = (len(moe) if axis == ALL_HIDDEN and moe is not None else
                    int(hidden) if axis == MOE_ONLY and hidden is not None else None)
    if other_layers and other_layers != layers and nbytes == rows * other_layers * topk * dt.itemsize:
        other = MOE_ONLY if axis == ALL_HIDDEN else ALL_HIDDEN
        return (f"; it is exactly {rows} rows x {other_layers} layers: the payload's layer axis is {other!r}, "
                f"not {axis!r}")
    for d_rows, words in ((1, "one row more: a row for the last token, or a start row one too small"),
                          (-1, "one row fewer: the final row missing, or a start row one too large")):
        if nbytes == (rows + d_rows) * layers * topk * dt.itemsize:
            return f"; it is {words}"
    return ""


# ----------------------------------------------------------------------------------- vLLM
def _field(payload: Any, name: str) -> Any:
    if isinstance(payload, Mapping):
        return payload.get(name)
    return getattr(payload, name, None)


def _int_array(value: Any, what: str, dtypes: Optional[Sequence[str]] = None) -> np.ndarray:
    a = np.asarray(value)
    if a.size == 0 and a.ndim < 3:
        a = a.reshape(0, 0, 0)
    if a.ndim != 3:
        raise _Refusal(f"{what} of shape {tuple(a.shape)}, not [rows, layers, K]")
    if a.dtype.kind not in "iu":
        raise _Refusal(f"{what} of dtype {a.dtype}, not integers")
    if dtypes is not None and not isinstance(value, list) and a.dtype.name not in dtypes:
        raise _Refusal(f"{what} of dtype {a.dtype}, not {'/'.join(dtypes)}")
    return a


def _vllm_split(payload: Any, *, start_row: int = 0, **_: Any) -> EngineRoutes:
    prompt, gen = _field(payload, "prompt_routed_experts"), _field(payload, "routed_experts")
    if prompt is None:
        raise _Refusal("no prompt_routed_experts field (a split payload carries the prompt's rows apart)")
    if gen is None:
        raise _Refusal("prompt_routed_experts without the choice's routed_experts")
    p = _int_array(prompt, "prompt_routed_experts", ("int16",))
    g = _int_array(gen, "routed_experts", ("int16",))
    if g.shape[0] and p.shape[1:] != g.shape[1:]:
        raise _Refusal(f"prompt_routed_experts {tuple(p.shape)} and routed_experts {tuple(g.shape)} disagree on "
                       f"[layers, K]")
    routes = np.concatenate([p, g.astype(p.dtype, copy=False)]) if g.shape[0] else p
    return EngineRoutes(routes, MOE_ONLY, int(start_row), "vllm-split-int16")


def _vllm_array(payload: Any, *, seq: int = 0, start_row: int = 0, **_: Any) -> EngineRoutes:
    if _field(payload, "prompt_routed_experts") is not None:
        raise _Refusal("a split payload (prompt_routed_experts: vLLM 0.21's form)")
    if _is_aux_keys(payload) or _is_aux_emissions(payload):
        raise _Refusal("an AuxOutput payload (vLLM 0.31+)")
    inner = payload.routed_experts if hasattr(payload, "routed_experts") else payload
    if isinstance(inner, Mapping):
        raise _Refusal(f"a dict with keys {sorted(inner)}")
    return EngineRoutes(np.asarray(decode_vllm_routes(inner, seq=seq)), ALL_HIDDEN, int(start_row), "vllm-array")


def _is_aux_keys(payload: Any) -> bool:
    return (isinstance(payload, (list, tuple)) and bool(payload)
            and all(isinstance(k, str) and k.startswith(AUX_OUTPUT_KEY_PREFIX) for k in payload))


def _is_aux_emissions(payload: Any) -> bool:
    return (isinstance(payload, (list, tuple)) and bool(payload)
            and all(_field(e, "token_start") is not None and _field(e, "rows") is not None for e in payload))


def _vllm_aux(payload: Any, *, seq: int = 0, start_row: int = 0, resolve: Optional[Callable] = None,
              num_hidden_layers: Optional[int] = None, topk: Optional[int] = None, dtype: Any = None,
              **_: Any) -> EngineRoutes:
    if _field(payload, "prompt_routed_experts") is not None:
        raise _Refusal("a split payload (prompt_routed_experts: vLLM 0.21's form)")
    if _is_aux_keys(payload):
        if resolve is None:
            raise _Refusal(f"routes by reference ({len(payload)} store keys such as {payload[0]!r}: the Mooncake "
                           f"backend's keys-only output) and no resolve= callable to read them (keys -> the "
                           f"concatenated block bytes); r3bridge never guesses missing blocks (they fail closed)")
        if num_hidden_layers is None or topk is None or dtype is None:
            raise _Refusal("routes by reference need num_hidden_layers, topk and dtype to read the blocks")
        raw = resolve(list(payload))
        if raw is None:
            raise _Refusal(f"resolve= returned nothing for {len(payload)} store keys (missing blocks fail closed)")
        per_row = int(num_hidden_layers) * int(topk) * np.dtype(dtype).itemsize
        raw = bytes(raw)
        if len(raw) % per_row:
            raise _Refusal(f"the {len(payload)} blocks hold {len(raw)} bytes, not whole rows of "
                           f"{num_hidden_layers} layers x top-{topk} x {np.dtype(dtype).itemsize} B")
        rows = len(raw) // per_row
        routes = decode_raw_routes(raw, dtype=dtype, tokens=rows + 1 + int(start_row), topk=int(topk),
                                   layer_axis=ALL_HIDDEN, num_hidden_layers=int(num_hidden_layers),
                                   start_row=int(start_row), seq=seq)
        return EngineRoutes(routes, ALL_HIDDEN, int(start_row), "vllm-auxoutput")
    if _is_aux_emissions(payload):
        parts, first, end = [], int(_field(payload[0], "token_start")), None
        for j, e in enumerate(payload):
            t0 = int(_field(e, "token_start"))
            rows = _int_array(_field(e, "rows"), f"emission {j}'s rows")
            if end is not None and t0 != end:
                gap = "overlaps the previous one" if t0 < end else f"leaves rows {end}..{t0 - 1} out"
                raise _Refusal(f"emission {j} starts at token {t0} where the previous ended at {end}: it {gap}")
            if parts and rows.shape[1:] != parts[0].shape[1:]:
                raise _Refusal(f"emission {j}'s rows {tuple(rows.shape)} change [layers, K] from {tuple(parts[0].shape)}")
            parts.append(rows)
            end = t0 + rows.shape[0]
        if first != int(start_row):
            raise _Refusal(f"the first emission starts at token {first}, the request's routed_experts_prompt_start "
                           f"is {start_row}")
        return EngineRoutes(np.concatenate(parts), ALL_HIDDEN, first, "vllm-auxoutput")
    # by value, already concatenated by the output processor: vLLM's array
    got = _vllm_array(payload, seq=seq, start_row=start_row)
    return EngineRoutes(got.routes, ALL_HIDDEN, got.start_row, "vllm-auxoutput")


# ----------------------------------------------------------------------------------- SGLang
def _sglang_values(meta_info: Any) -> tuple[Any, str]:
    if not isinstance(meta_info, Mapping):
        raise _Refusal(f"a {type(meta_info).__name__}, not SGLang's meta_info dict")
    if "routed_experts" not in meta_info:
        ext = meta_info.get("sgl_ext")
        if isinstance(ext, Mapping) and "routed_experts" in ext:    # the OpenAI endpoints' choice field
            return ext["routed_experts"], "sgl_ext.routed_experts"
    # missing: None, which decode_sglang_routes refuses naming the server flag and the request field
    return meta_info.get("routed_experts"), "meta_info.routed_experts"


def _is_double_base64(raw: bytes) -> bool:
    """int32 expert ids below 2**24 have a zero high byte, never a base64 character: bytes that
    are all base64 text are a base64 string encoded again."""
    if not raw or len(raw) % 4:
        return False
    try:
        base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _sglang(meta_info: Any, *, seq: int, start_row: int, num_hidden_layers: Optional[int], topk: Optional[int],
            base64_only: bool, name: str, **_: Any) -> EngineRoutes:
    values, where = _sglang_values(meta_info)
    wire = meta_info.get(SGLANG_WIRE_DTYPE_KEY) if isinstance(meta_info, Mapping) else None
    rows = None
    if isinstance(meta_info, Mapping) and {"prompt_tokens", "completion_tokens"} <= set(meta_info):
        rows = int(meta_info["prompt_tokens"]) + int(meta_info["completion_tokens"]) - 1 - int(start_row)
    if wire is not None:
        if wire not in SGLANG_WIRE_DTYPES:
            raise _Refusal(f"{SGLANG_WIRE_DTYPE_KEY}={wire!r}, not one of {sorted(SGLANG_WIRE_DTYPES)}")
        if not isinstance(values, (str, bytes, bytearray)):
            raise _Refusal(f"{where} is a {type(values).__name__} with a wire dtype: the wire form is base64")
        flat = _b64(values, SGLANG_WIRE_DTYPES[wire], where)
        name = "sglang-wire-dtype"
    elif isinstance(values, (str, bytes, bytearray)):
        flat = _b64(values, "<i4", where)
    elif base64_only and values is not None:
        raise _Refusal(f"{where} is a {type(values).__name__}: from 0.5.11 the tokenizer manager hands base64 on "
                       f"every path")
    else:
        return EngineRoutes(decode_sglang_routes(values, num_layers=num_hidden_layers, topk=topk, rows=rows, seq=seq),
                            ALL_HIDDEN, int(start_row), name)
    return EngineRoutes(decode_sglang_routes(flat, num_layers=num_hidden_layers, topk=topk, rows=rows, seq=seq),
                        ALL_HIDDEN, int(start_row), name)


def _b64(values: Any, dtype: str, where: str) -> np.ndarray:
    try:
        raw = base64.b64decode(values, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _Refusal(f"{where} is not valid base64 ({e})") from None
    if dtype == "<i4" and _is_double_base64(raw):
        raise _Refusal(f"{where} is base64 of base64 text: a client encoded SGLang's already-encoded string again "
                       f"(dynamo #10543: SGLang 0.5.11 moved the encoding into the tokenizer manager); hand over "
                       f"the string as SGLang returned it")
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise _Refusal(f"{where} decodes to {len(raw)} bytes, not a whole number of {np.dtype(dtype).name} values")
    return np.frombuffer(raw, dtype=dtype)


def _sglang_before_0511(meta_info: Any, **kw: Any) -> EngineRoutes:
    return _sglang(meta_info, base64_only=False, name="sglang-int32", **kw)


def _sglang_from_0511(meta_info: Any, **kw: Any) -> EngineRoutes:
    return _sglang(meta_info, base64_only=True, name="sglang-int32-base64", **kw)


# ----------------------------------------------------------------------------------- the table
ROUTE_FORMATS: tuple[RouteFormat, ...] = (
    RouteFormat("vllm", ">=0.21,<0.22", "vllm-split-int16", MOE_ONLY,
                "prompt_routed_experts [prompt, moe_layers, K] + routed_experts [generated - 1, moe_layers, K], int16 "
                "(JSON lists)", _vllm_split),
    RouteFormat("vllm", ">=0.22,<0.31", "vllm-array", ALL_HIDDEN,
                "one routed_experts array [tokens - 1 - start, num_hidden_layers, K], uint8 / uint16 (HTTP: base64 "
                ".npy)", _vllm_array),
    RouteFormat("vllm", ">=0.31", "vllm-auxoutput", ALL_HIDDEN,
                "AuxOutput rows [tokens - 1 - start, num_hidden_layers, K]: the array, its (token_start, rows) "
                "emissions, or vllm-artifact/ store keys with resolve=", _vllm_aux),
    RouteFormat("sglang", "<0.5.11", "sglang-int32", ALL_HIDDEN,
                "meta_info routed_experts: base64 of flat int32 [tokens - 1 - start, num_hidden_layers, K] "
                "(or the raw tensor with skip_tokenizer_init)", _sglang_before_0511),
    RouteFormat("sglang", ">=0.5.11", "sglang-int32-base64", ALL_HIDDEN,
                "meta_info (or sgl_ext) routed_experts: base64 of flat int32 [tokens - 1 - start, num_hidden_layers, "
                "K], encoded once by the tokenizer manager (routed_experts_dtype names a narrower wire, #31219)",
                _sglang_from_0511),
)


def _version(engine: str, version: Any) -> Version:
    try:
        return version if isinstance(version, Version) else Version(str(version))
    except InvalidVersion:
        raise PayloadError(f"{_NAMES.get(engine, engine)} release {version!r} is not a version number") from None


def route_format(engine: str, version: Any) -> RouteFormat:
    """The format ``engine`` ships in ``version``; refused when no row of :data:`ROUTE_FORMATS` covers it."""
    v = _version(engine, version)
    rows = [f for f in ROUTE_FORMATS if f.engine == engine]
    if not rows:
        raise PayloadError(f"no route format is known for engine {engine!r} (known: "
                           f"{sorted({f.engine for f in ROUTE_FORMATS})})")
    for f in rows:
        if f.covers(v):
            return f
    known = "; ".join(f"{f.releases}: {f.name}" for f in rows)
    raise PayloadError(f"{_NAMES.get(engine, engine)} {v}: no route format read for this release (known: {known}); "
                       f"r3bridge refuses what it has not read")


def vllm_needs_format(item: Any) -> bool:
    """Whether a vLLM item is in a form only the format table reads (0.21's split lists, 0.31+'s
    AuxOutput emissions or store keys), not the array every other path takes as it is."""
    return _field(item, "prompt_routed_experts") is not None or _is_aux_keys(item) or _is_aux_emissions(item)


def _sniff(engine: str, payload: Any) -> RouteFormat:
    """The format a payload's own fields say, for a caller that does not know the release."""
    by_name = {f.name: f for f in ROUTE_FORMATS}
    if engine == "vllm":
        if _field(payload, "prompt_routed_experts") is not None:
            return by_name["vllm-split-int16"]
        if _is_aux_keys(payload) or _is_aux_emissions(payload):
            return by_name["vllm-auxoutput"]
        return by_name["vllm-array"]
    if engine == "sglang":
        return by_name["sglang-int32"]          # accepts every SGLang form; the release narrows it
    raise PayloadError(f"no route format is known for engine {engine!r}")


def decode_engine_routes(engine: str, payload: Any, *, version: Any = None, seq: int = 0, start_row: int = 0,
                         num_hidden_layers: Optional[int] = None, topk: Optional[int] = None,
                         resolve: Optional[Callable[[list[str]], bytes]] = None, dtype: Any = None) -> EngineRoutes:
    """One request's routes from ``engine`` (``"vllm"`` / ``"sglang"``) in the format its release
    ships (``version``; ``None``: read from the payload's own fields). ``start_row``: the request's
    prompt start (vLLM ``routed_experts_prompt_start``, SGLang ``routed_experts_start_len``).
    ``num_hidden_layers`` / ``topk``: SGLang's flat ids need them; by-reference AuxOutput too, with
    the blocks' ``dtype`` and ``resolve`` (keys -> bytes). Refused (``PayloadError``) with one
    message naming the engine, the release and what was expected when the payload is not that
    release's format."""
    fmt = route_format(engine, version) if version is not None else _sniff(engine, payload)
    try:
        return fmt.decode(payload, seq=seq, start_row=start_row, num_hidden_layers=num_hidden_layers, topk=topk,
                          resolve=resolve, dtype=dtype)
    except _Refusal as why:
        release = f"{_NAMES.get(engine, engine)} {version}" if version is not None else \
            f"{_NAMES.get(engine, engine)} (release not given, read as {fmt.name})"
        raise PayloadError(f"sequence {seq}: {release} ships {fmt.name} ({fmt.expects}); got {why}") from None
