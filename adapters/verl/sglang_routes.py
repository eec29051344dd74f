"""verl 0.9.1's SGLang rollout (``actor_rollout_ref.rollout.name=sglang``) with its routes read by r3bridge.

verl 0.9.1's ``SGLangHttpServer.generate`` (``verl/workers/rollout/sglang_rollout/async_sglang_server.py``
:681-698) reads the routes SGLang returns in one of two ways, and neither works with the SGLang
release verl 0.9.1 pins (0.5.12):

* ``skip_tokenizer_init=True`` (verl's default, ``rollout.yaml``): ``meta_info["routed_experts"].numpy()``,
  the raw tensor SGLang handed over before 0.5.11. From 0.5.11 the tokenizer manager base64-encodes
  the routes on that path too (0.5.12 ``srt/managers/tokenizer_manager.py`` :1726-1733): a ``str``,
  ``AttributeError: 'str' object has no attribute 'numpy'`` on the first request with routes;
* ``skip_tokenizer_init=False``: ``from sglang.srt.layers.moe.routed_experts_capturer import
  extract_routed_experts_from_meta_info``, a module 0.5.12 no longer has (it moved to
  ``sglang.srt.state_capturer.routed_experts``): ``ModuleNotFoundError``.

So r3bridge reads them itself, through :mod:`r3bridge.engines` (engine ``sglang``; the release
installed in the server's environment, or ``r3bridge.engine_version``; the decoder chosen by the
release, an unknown release or a payload in another format refused), and hands verl's own reading
what it expects: :class:`RoutesReadingTokenizerManager` wraps the server's tokenizer manager (that
one object, the server's attribute; no SGLang or verl class changed) and puts the decoded
``[prompt + completion - 1, num_hidden_layers, K]`` tensor where verl calls ``.numpy()``; verl hands
it to its agent loop as ``TokenOutput.routed_experts``, the layout of vLLM's array (every hidden
layer, rows from token 0). The server and replica subclasses that install it
(:mod:`r3bridge.adapters.verl.sglang_server`, importable only where SGLang is) serve verl's own
rollout name ``sglang`` (:func:`register_sglang_rollout`, verl's ``RolloutReplicaRegistry``), so every
other verl path keyed on that name (weight sync's resume, the checkpoint engine, the agent loop's
media handling) stays verl's. ``skip_tokenizer_init=False`` with routes is refused
(:func:`check_sglang_rollout`): verl's other path fails on the missing module before anything could
read them.
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from packaging.version import Version

from r3bridge.engines.decoders import sglang_rows
from r3bridge.engines.engine_settings import engine_release
from r3bridge.engines.layer_ids import check_dense_layers_empty
from r3bridge.engines.route_formats import decode_engine_routes, route_format
from r3bridge.errors import ConfigError, PayloadError, ReplayError

__all__ = ["SGLANG", "sglang_release", "verl_routes", "RoutesReadingTokenizerManager", "check_sglang_rollout",
           "register_sglang_rollout"]

logger = logging.getLogger("r3bridge.adapters.verl")
SGLANG = "sglang"        # verl's rollout name, and r3bridge's engine name


def sglang_release(configured: Optional[str] = None) -> Version:
    """The SGLang release whose routes the server reads: ``configured`` (``r3bridge.engine_version``)
    else the distribution installed in this process's environment; unknown or without a route
    format of its own (:data:`r3bridge.engines.route_formats.ROUTE_FORMATS`): refused."""
    release = engine_release(SGLANG, configured)
    if release.version is None:
        raise ConfigError("verl's SGLang rollout with routing replay: no SGLang release found in the server's "
                          "environment and r3bridge.engine_version is not set; r3bridge reads SGLang's routes by "
                          "release and does not guess one")
    route_format(SGLANG, release.version)      # a release no known format covers: refused here, before serving
    return release.version


def verl_routes(output: Mapping[str, Any], *, version: Any, num_hidden_layers: int, topk: int,
                moe_layer_ids: Optional[Sequence[int]] = None, request: str = "", start_row: int = 0) -> torch.Tensor:
    """One SGLang ``generate_request`` output (``{"output_ids", "meta_info": {..., "routed_experts"}}``)
    -> the routes verl's ``TokenOutput.routed_experts`` carries: ``[prompt_tokens + completion_tokens
    - 1, num_hidden_layers, K]`` (every hidden layer, rows from token 0, the engine's integer dtype),
    decoded by ``version``'s format. Refused (a :class:`~r3bridge.errors.ReplayError` naming the
    request): no ``meta_info`` or token counts, a payload not in that release's format or of another
    row count / shape, a ``start_row`` (verl's rows start at token 0), and ids on a layer
    ``moe_layer_ids`` leaves out (the engine ran experts where the trainer's model is dense)."""
    where = f"SGLang request {request!r}" if request else "SGLang request"
    meta = output.get("meta_info") if isinstance(output, Mapping) else None
    if not isinstance(meta, Mapping):
        raise PayloadError(f"{where}: the output carries no meta_info dict (got {type(output).__name__} with "
                           f"{type(meta).__name__} meta_info); its routes cannot be read")
    if int(start_row):
        raise PayloadError(f"{where}: routed_experts_start_len={start_row}, but verl's TokenOutput.routed_experts "
                           f"rows start at token 0 (verl 0.9.1 never sets a start)")
    try:
        sglang_rows(meta, seq=0)          # prompt_tokens / completion_tokens present and integers
        got = decode_engine_routes(SGLANG, meta, version=version, num_hidden_layers=int(num_hidden_layers),
                                   topk=int(topk))
        routes = np.array(got.routes, copy=True)          # SGLang's buffer is read-only: verl gets its own
        if moe_layer_ids is not None:
            check_dense_layers_empty(routes, list(moe_layer_ids), layer_dim=1, field="routed_experts")
    except ReplayError as e:
        raise type(e)(f"{where}: {e}") from None
    return torch.from_numpy(routes)


class RoutesReadingTokenizerManager:
    """SGLang's tokenizer manager as verl's SGLang server calls it (``await
    tokenizer_manager.generate_request(obj, None).__anext__()``), with each output of a request that
    asked for routes (``obj.return_routed_experts``) carrying them decoded: ``read(output, request)``
    (:func:`verl_routes` with the model's facts and the release bound) replaces
    ``meta_info["routed_experts"]``; an output without routes passes as it is (verl hands ``None``
    on). Every other attribute is the wrapped manager's."""

    def __init__(self, inner: Any, *, read: Callable[..., Any]) -> None:
        self._inner = inner
        self._read = read

    def generate_request(self, obj: Any, request: Any = None) -> AsyncIterator[Any]:
        stream = self._inner.generate_request(obj, request)
        if not getattr(obj, "return_routed_experts", False):
            return stream
        return self._decoded(stream, obj)

    async def _decoded(self, stream: AsyncIterator[Any], obj: Any) -> AsyncIterator[Any]:
        async for out in stream:
            meta = out.get("meta_info") if isinstance(out, Mapping) else None
            if isinstance(meta, Mapping) and meta.get("routed_experts") is not None:
                routes = self._read(out, request=str(getattr(obj, "rid", "")),
                                    start_row=int(getattr(obj, "routed_experts_start_len", 0) or 0))
                out = {**out, "meta_info": {**meta, "routed_experts": routes}}
            yield out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def check_sglang_rollout(rollout_config: Any) -> None:
    """verl's rollout config (``actor_rollout_ref.rollout``, the dict or verl's ``RolloutConfig``)
    with routing replay on SGLang: ``skip_tokenizer_init`` must stay on (verl's default), the one path
    r3bridge reads (the module docstring says why the other cannot work)."""
    if bool(_get(rollout_config, "enable_rollout_routing_replay", False)) and not bool(
            _get(rollout_config, "skip_tokenizer_init", True)):
        raise ConfigError("actor_rollout_ref.rollout.skip_tokenizer_init=False with enable_rollout_routing_replay "
                          "on the SGLang rollout: verl 0.9.1 then reads the routes through "
                          "sglang.srt.layers.moe.routed_experts_capturer, which SGLang 0.5.12 (verl's pin) no longer "
                          "has (ModuleNotFoundError on the first request); keep skip_tokenizer_init=True (verl's "
                          "default), where r3bridge reads SGLang's routes")


def register_sglang_rollout() -> bool:
    """Serve verl's rollout name ``sglang`` with :class:`~r3bridge.adapters.verl.sglang_server.R3SGLangReplica`
    (verl's ``RolloutReplicaRegistry``; its loader runs verl's own SGLang loader first, so what
    verl prepares for SGLang's imports is kept). Idempotent; SGLang is imported only when verl
    starts an SGLang rollout. Returns whether this call registered it."""
    from verl.workers.rollout import replica

    from r3bridge.versions import check_internals

    check_internals("verl", [
        ("verl.workers.rollout.replica.RolloutReplicaRegistry._registry", replica.RolloutReplicaRegistry, "_registry"),
        ("verl.workers.rollout.replica._load_sglang", replica, "_load_sglang")])
    if replica.RolloutReplicaRegistry._registry.get(SGLANG) is _load_sglang_replica:
        return False
    replica.RolloutReplicaRegistry.register(SGLANG, _load_sglang_replica)
    return True


def _load_sglang_replica() -> type:
    from verl.workers.rollout import replica

    replica._load_sglang()         # verl's loader: the environment and import stand-ins SGLang's import needs
    from r3bridge.adapters.verl.sglang_server import R3SGLangReplica

    logger.info("r3bridge: verl's SGLang rollout reads its routes through r3bridge.engines (R3SGLangReplica)")
    return R3SGLangReplica
