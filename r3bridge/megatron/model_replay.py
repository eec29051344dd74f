"""`ModelReplay`: one model's :class:`~r3bridge.megatron.AdapterSession` and what an adapter carries
to its passes between the framework's calls.

A framework hands over what a pass needs at different calls: which routes the batch carries (a
worker's batch metadata), the pass's provenance (from the whole batch, before the framework cuts
it into micro-batches that carry only routes), and it logs metrics only where it collects them
(e.g. each update micro-batch's metrics dict). An adapter whose hooks sit at such separate calls
holds them here (SkyRL's ``SkyRLReplay`` subclasses it); one whose single hook sees all of it
calls the session directly.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

from r3bridge.batch.provenance import ProvenancePairing
from r3bridge.batch.recorded import per_sample_payloads
from r3bridge.batch.schema import ReplayBatch
from r3bridge.config import Phase, PhasePlan
from r3bridge.errors import ConfigError
from r3bridge.megatron.session import AdapterSession, averaged

__all__ = ["ModelReplay"]


class ModelReplay:
    """One model's session; ``route_kind``, ``provenance`` and ``log_metrics`` carried between calls."""

    def __init__(self, session: AdapterSession) -> None:
        self.session = session
        self.route_kind: Optional[str] = None   # which routes the batch carries (None: not told)
        # the next pass's route / log-prob provenance: used once (take_provenance)
        self.provenance: Optional[ProvenancePairing] = None
        # the last update's + its compute_log_prob's, tagged; r3bridge/replay_mode always (also off)
        self.log_metrics: dict[str, float] = session.replay_mode_metric

    @property
    def replayer(self) -> Any:
        return self.session.replayer

    @property
    def metrics(self) -> dict[str, float]:
        """The last pass's metrics, as the driver names them."""
        return {} if self.session.result is None else dict(self.session.result.metrics)

    @property
    def recorded(self) -> Optional[ReplayBatch]:
        """The last pass's R2 recording (real samples, sample-id order)."""
        return None if self.session.result is None else self.session.result.recorded

    def take_provenance(self) -> Optional[ProvenancePairing]:
        """The provenance set for the next pass, once: never a later pass's."""
        pairing, self.provenance = self.provenance, None
        return pairing

    @contextlib.contextmanager
    def providing(self, pairing: Optional[ProvenancePairing]) -> Iterator[None]:
        """``pairing`` is the provenance of the pass inside this block only (a framework call that
        runs it), never a later pass's."""
        self.provenance = pairing
        try:
            yield
        finally:
            self.provenance = None

    def record_into(self, outputs: Callable[[], Sequence[dict]], key: str) -> None:
        """R2: the last pass's recording, one payload per sample (:mod:`r3bridge.batch.recorded`),
        into ``outputs()[i][key]`` (a framework's per-sample output dicts); nothing on a pipeline
        stage other than the last, whose outputs are placeholders the framework never reads."""
        from megatron.core import parallel_state as mpu

        if not mpu.is_pipeline_last_stage(ignore_virtual=True):
            return
        samples = outputs()
        for out, payload in zip(samples, per_sample_payloads(self.session.recorded_for(len(samples)))):
            out[key] = payload

    def check_route_kind(self, plan: PhasePlan) -> None:
        """``ConfigError`` when the batch carries other routes than the replay pass replays."""
        if self.route_kind is not None and self.route_kind != plan.route_kind:
            raise ConfigError(f"replay_mode={self.session.mode.value} replays {plan.route_kind} routes, the batch "
                              f"carries {self.route_kind} routes")

    def log_pass(self, phase: Phase) -> None:
        """After a pass: an update's metrics (with the compute_log_prob's the session held for it),
        one value per key, become :attr:`log_metrics`."""
        logged = self.session.metrics_to_log(self.session.result)
        if phase is Phase.UPDATE:
            self.log_metrics = averaged(logged)

    def add_metrics(self, metrics_list: Any) -> Any:
        """:attr:`log_metrics` into each dict of ``metrics_list`` (a framework's per-micro-batch
        metrics, which it averages over micro-batches and ranks and logs)."""
        if isinstance(metrics_list, list):
            for m in metrics_list:
                if isinstance(m, dict):
                    m.update(self.log_metrics)
        return metrics_list
