"""`Replayer`: attaches r3bridge's hook to every decoder router of the model chunks and hands out
one :class:`ReplayPass` per pass (one schedule run). See docs/driver-api.md."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from r3bridge.config import REPLAY_WEIGHTS, Action, PhasePlan, ReplayConfig, check_replay_weights
from r3bridge.engines.layer_ids import shifted_layer_ids_hint
from r3bridge.engines.route_checks import DEGENERATE_CHOICES
from r3bridge.errors import ConfigError, LayerMappingError, ReplayStateError, RoleError
from r3bridge.megatron.compat import check_megatron, router_takes_padding_mask
from r3bridge.megatron.discovery import ChunkRouters, check_against_layout, find_routers, layout_for, unwrap
from r3bridge.megatron.guards import check_config
from r3bridge.megatron.hook import RouterHook
from r3bridge.megatron.replay_pass import ReplayPass
from r3bridge.megatron.roles import Role, check_actor, declare_role, model_role
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.read import ReadStats
from r3bridge.replay_policy import check_policy


def _parallel_state_ranks() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return dict(tp_rank=0, cp_rank=0, pp_rank=0, groups={}, metrics_groups=[])
    return dict(
        tp_rank=ps.get_tensor_model_parallel_rank(), cp_rank=ps.get_context_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        groups={"tp": ps.get_tensor_model_parallel_group(), "cp": ps.get_context_parallel_group(),
                "pp": ps.get_pipeline_model_parallel_group()},
        # agreement counts are summed over TP x PP, then CP: the ranks that share samples
        metrics_groups=[ps.get_model_parallel_group(), ps.get_context_parallel_group()],
    )


class Replayer:
    """Routing replay for one model (its list of chunks, one per virtual pipeline stage)."""

    def __init__(self, model_chunks: Sequence[torch.nn.Module] | torch.nn.Module,
                 layout: Optional[ParallelLayout] = None, *, agreement: bool = True,
                 min_coverage: float = 0.0, invalid_rows: str = "native", metrics_prefix: str = "r3bridge/",
                 mask_unrouted_rows: bool = True,
                 tp_rank: Optional[int] = None, cp_rank: Optional[int] = None,
                 pp_rank: Optional[int] = None, groups: Optional[dict[str, Any]] = None,
                 expect_moe_layer_ids: Optional[Sequence[int]] = None, replay_policy: str = "hard",
                 threshold_ratio: float = 0.5, role: Role | str = Role.ACTOR, coverage_floor: float = 0.0,
                 degenerate_routes: str = "refuse", replay_weights: str = "off") -> None:
        """``replay_weights``: the job's routing-weights setting (``ReplayConfig.replay_weights``);
        when it is not ``off``, every pass must be opened with its phase's plan (or its flags), so
        a pass opened from the action alone never replays ids only in silence.
        ``expect_moe_layer_ids``: the MoE layers the routes are indexed by (from the HF config,
        :class:`r3bridge.hf.ModelInfo`); refused unless they are the model's, else routes would
        land on the wrong layers (field notes 8.4: the dense-layer shift). ``role``: the role the framework
        built this model for; anything but ``actor`` is refused (:mod:`r3bridge.megatron.roles`)."""
        check_megatron()
        if Role.of(role) is not Role.ACTOR:
            raise RoleError(f"a Replayer was asked for the {Role.of(role).value} model: only the actor replays "
                            f"(the {Role.of(role).value} must route natively)")
        if invalid_rows not in ("native", "error"):
            raise ConfigError(f"invalid_rows must be 'native' or 'error', got {invalid_rows!r}")
        if degenerate_routes not in DEGENERATE_CHOICES:
            raise ConfigError(f"degenerate_routes must be one of {', '.join(DEGENERATE_CHOICES)}, got "
                              f"{degenerate_routes!r}")
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        if not chunks:
            raise ConfigError("Replayer needs at least one model chunk")
        config = unwrap(chunks[0]).config
        check_config(config)
        ps = _parallel_state_ranks()
        self.tp_rank = ps["tp_rank"] if tp_rank is None else tp_rank
        self.cp_rank = ps["cp_rank"] if cp_rank is None else cp_rank
        self.pp_rank = ps["pp_rank"] if pp_rank is None else pp_rank
        self.groups = ps["groups"] if groups is None else groups
        self.metrics_groups = ps["metrics_groups"] if groups is None else list(groups.get("metrics", []))
        self.layout = layout if layout is not None else layout_for(chunks, config)
        if expect_moe_layer_ids is not None and [int(i) for i in expect_moe_layer_ids] != list(self.layout.moe_layer_ids):
            raise LayerMappingError(f"the HF config's MoE layers {[int(i) for i in expect_moe_layer_ids]} differ from "
                                    f"the Megatron model's {list(self.layout.moe_layer_ids)} (moe_layer_freq): routes "
                                    f"would land on the wrong layers"
                                    f"{shifted_layer_ids_hint(expect_moe_layer_ids, self.layout.moe_layer_ids)}")
        self.num_experts = int(config.num_moe_experts)
        self.topk = int(config.moe_router_topk)
        self.agreement = agreement
        self.min_coverage = float(min_coverage)
        # R3: a pass covering less of its tokens fails (ReplayConfig.coverage_floor; 0: never)
        self.coverage_floor = float(coverage_floor)
        self.degenerate_routes = degenerate_routes
        if replay_weights not in REPLAY_WEIGHTS:
            raise ConfigError(f"replay_weights must be one of {', '.join(REPLAY_WEIGHTS)}, got {replay_weights!r}")
        self.replay_weights = replay_weights
        self.invalid_rows = invalid_rows
        self.metrics_prefix = metrics_prefix
        check_policy(replay_policy, threshold_ratio)
        self.replay_policy = replay_policy
        self.threshold_ratio = float(threshold_ratio)
        # what megatron-core hands the replay hook (moe_utils.topk_routing_with_score_function):
        # a softmax router without pre-softmax ranks raw logits, every other router probabilities
        self.score_space = ("logits" if config.moe_router_score_function == "softmax"
                            and not config.moe_router_pre_softmax else "probs")
        self.topk_scaling_factor = config.moe_router_topk_scaling_factor
        if replay_policy == "threshold" and getattr(config, "moe_router_enable_expert_bias", False):
            # the scores ranked are score + bias, not the gate score the threshold compares
            raise ConfigError("replay_policy='threshold' with moe_router_enable_expert_bias: the router ranks "
                              "biased scores, so 'the weakest native score' has no gate-score meaning; use "
                              "replay_policy='hard'")
        # rows without a route kept out of aux loss / z-loss / expert-bias counts (stats_mask.py);
        # False only to measure what they would change (scripts/padding_mask_effect.py)
        self.mask_unrouted_rows = bool(mask_unrouted_rows) and router_takes_padding_mask()
        self.chunks: list[ChunkRouters] = find_routers(chunks)
        check_against_layout(self.chunks, self.layout, self.pp_rank)
        self.layer_chunk: dict[int, int] = {lid: c.vp_stage for c in self.chunks for lid in c.routers}
        self.active_pass: Optional[ReplayPass] = None
        self.read_stats = ReadStats()      # every route read by the one reader (docs/architecture.md, "One reader")
        self.unmanaged_calls = 0
        self._previous: dict[int, Any] = {}
        # MTP (draft) routers are never in layer_chunk: find_routers keeps them apart, by object,
        # whatever layer_number they alias (NeMo RL #3903); declare_role marks them draft and
        # refuses any replay object on them.
        declare_role(chunks, Role.ACTOR)
        self._hooks: dict[int, RouterHook] = {}
        for c in self.chunks:
            for lid, router in c.routers.items():
                if isinstance(router.router_replay, RouterHook):
                    raise ConfigError(f"layer {lid}'s router already belongs to another Replayer: two replays "
                                      f"at once; detach() the other one first")
        for c in self.chunks:
            for lid, router in c.routers.items():
                self._previous[lid] = router.router_replay
                router.router_replay = self._hooks[lid] = RouterHook(self, c.vp_stage, lid)
        self._actor_routers = {lid: r for c in self.chunks for lid, r in c.routers.items()}

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are *now*: targets are built there and the R2 gather
        runs there (a stage without MoE layers takes part too; NCCL refuses CPU tensors).
        Read per pass, not at construction: frameworks offload parameters to the CPU between
        phases (parameter offload) and reload them before a forward."""
        for c in self.chunks:
            for p in c.chunk.parameters():
                return p.device
        return torch.device("cpu")

    @classmethod
    def from_config(cls, model_chunks: Sequence[torch.nn.Module] | torch.nn.Module, config: ReplayConfig,
                    layout: Optional[ParallelLayout] = None, **kwargs: Any) -> "Replayer":
        """Every option of the job's ``r3bridge`` section, so adapters cannot forget one."""
        check_replay_weights(config.replay_mode, config.replay_weights)
        return cls(model_chunks, layout, agreement=config.agreement, min_coverage=config.min_coverage,
                   invalid_rows=config.invalid_rows, metrics_prefix=config.metrics_prefix,
                   replay_policy=config.replay_policy, threshold_ratio=config.threshold_ratio,
                   coverage_floor=config.coverage_floor, degenerate_routes=config.degenerate_routes,
                   replay_weights=config.replay_weights, **kwargs)

    # -------------------------------------------------------------------------------- public
    def open_pass(self, action: PhasePlan | Action | str, *, forward_only: bool, route_kind: str | None = None,
                  replay_weights: Optional[bool] = None, record_weights: Optional[bool] = None) -> ReplayPass:
        """One pass (one schedule run); use as a context manager. ``action``: the phase's plan
        (:func:`r3bridge.config.phase_plan`: its action, route kind and routing-weights flags), or
        the plan's action with ``route_kind`` (the kind of routes, "rollout" / "recorded", checked
        against each installed batch) and ``replay_weights`` / ``record_weights`` (routing weights:
        :mod:`r3bridge.megatron.combine_weights`; left out: off, refused when this Replayer was
        configured with a ``replay_weights`` setting)."""
        check_actor(self._actor_routers, self._hooks)
        if isinstance(action, PhasePlan):
            plan = action
            given = {k: v for k, v in (("route_kind", route_kind), ("replay_weights", replay_weights),
                                       ("record_weights", record_weights)) if v is not None}
            clash = {k: v for k, v in given.items() if getattr(plan, k) != v}
            if clash:
                raise ConfigError(f"open_pass({plan}): {clash} contradict the plan")
            action, route_kind = plan.action, plan.route_kind
            replay_weights, record_weights = plan.replay_weights, plan.record_weights
        if replay_weights is None and record_weights is None and self.replay_weights != "off" \
                and Action(action) is not Action.NATIVE:
            raise ConfigError(f"replay_weights={self.replay_weights!r} is set for this model, and this {Action(action).value} "
                              f"pass was opened without its routing-weights flags: open it with the phase's plan, "
                              f"open_pass(phase_plan(...) or config.plan(phase), forward_only=...), else it would "
                              f"replay expert ids only")
        return ReplayPass(self, action, forward_only=forward_only, route_kind=route_kind,
                          replay_weights=bool(replay_weights), record_weights=bool(record_weights))

    def chunk_index(self, model: torch.nn.Module | int) -> int:
        if isinstance(model, int):
            if not 0 <= model < len(self.chunks):
                raise ReplayStateError(f"chunk index {model} out of range for {len(self.chunks)} chunks")
            return model
        for i, c in enumerate(self.chunks):
            if c.chunk is model or unwrap(c.chunk) is model:
                return i
        other = model_role(model)
        if other is not None and other is not Role.ACTOR:
            raise RoleError(f"actor routes were installed on a model chunk of the {other.value} model: the "
                            f"{other.value} never replays (only the actor's Replayer chunks take routes)")
        raise ReplayStateError(f"{type(model).__name__} is not one of this Replayer's model chunks")

    @property
    def layer_ids(self) -> list[int]:
        return sorted(self.layer_chunk)

    @property
    def mtp_router_count(self) -> int:
        return sum(len(c.mtp_routers) for c in self.chunks)

    def detach(self) -> None:
        """Give every router its previous ``router_replay`` back."""
        if self.active_pass is not None:
            raise ReplayStateError("detach() during an active pass")
        for c in self.chunks:
            for lid, router in c.routers.items():
                router.router_replay = self._previous.get(lid)
        self._previous.clear()
        self._hooks.clear()
        self._actor_routers.clear()
