"""Conformance checks 1-5 as pytest base classes: an adapter's test module is a fixtures class and
two one-line test classes, run with plain ``pytest``, in r3bridge's tree or anywhere else.

These classes are intended for adapters outside r3bridge to subclass; moving or renaming them,
their tests or their fixtures is not done lightly. The asserts and thresholds are
:mod:`r3bridge.testing.kit.conformance`'s (the plain functions, for use without pytest)::

    class MyFwFixtures(AdapterFixtures):
        @pytest.fixture
        def codec(self, rollout):
            return MyFwCodec(num_experts=rollout.num_experts, moe_layer_ids=rollout.moe_layer_ids,
                             num_hidden_layers=rollout.num_layers, topk=rollout.topk)

        @pytest.fixture
        def native_batch(self, rollout):
            return my_framework_batch(rollout)        # built by the framework's own code

        @pytest.fixture(scope="class")
        @classmethod
        def megatron_runner(cls):
            return MyFwRunner                         # picklable: rollout -> MegatronRunner

    class TestMyFwIngest(BaseIngestTests, MyFwFixtures):       # checks 1-3
        pass

    class TestMyFwMegatron(BaseMegatronTests, MyFwFixtures):   # checks 4-5
        pass

The fixtures with a default (model shape, layouts, seeds, thresholds) are overridden the same
way. The Megatron fixtures are class-scoped (one set of rank processes per world size serves
both of checks 4-5): override them with ``@pytest.fixture(scope="class")`` over ``@classmethod``.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import pytest

from r3bridge.batch.schema import ReplayBatch
from r3bridge.testing.kit import conformance as kit
from r3bridge.testing.kit.rollouts import CanonicalRollout, ModelShape

__all__ = ["AdapterFixtures", "BaseIngestTests", "BaseMegatronTests"]


class AdapterFixtures:
    """The fixtures checks 1-5 ask for. Subclass it and override the three stubs (``codec``,
    ``native_batch``, ``megatron_runner``); the others have defaults."""

    # ------------------------------------------------------------------------------ stubs
    @pytest.fixture
    def codec(self, rollout: CanonicalRollout) -> Any:
        """The adapter's :class:`r3bridge.protocols.BatchCodec` for a model of the rollout's
        shape: ``rollout.num_experts`` experts, MoE layers ``rollout.moe_layer_ids`` of
        ``rollout.num_layers`` decoder layers, top-``rollout.topk``."""
        raise NotImplementedError("override the `codec` fixture: the adapter's BatchCodec for the rollout's model")

    @pytest.fixture
    def native_batch(self, rollout: CanonicalRollout) -> Any:
        """The framework's training batch of the rollout's samples, in order, built by the
        framework's own code from what the engine returned (``rollout.calls[i][t]``: the routes of
        every decoder layer, dense ones zero, engine call ``t`` of sample ``i`` returned from row
        0 of its prompt; ``rollout.tokens[i]``: the trajectory the trainer sees), with the routes
        in the framework's own transport. A fresh batch per call: check 2 writes into it."""
        raise NotImplementedError("override the `native_batch` fixture: the framework's batch of the rollout")

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_runner(cls) -> Any:
        """A picklable callable ``rollout -> MegatronRunner`` (a class, or a ``functools.partial``
        of one; not a lambda: it travels to spawned ranks): the framework's engine on harness
        chunks, see :class:`r3bridge.testing.kit.runner.MegatronRunner` for what it must do."""
        raise NotImplementedError("override the `megatron_runner` fixture (scope='class'): rollout -> MegatronRunner")

    # ------------------------------------------------------------------------------ defaults
    @pytest.fixture(scope="class")
    @classmethod
    def model_shape(cls) -> ModelShape:
        """Experts, top-k, layers and which layers are MoE (0-based global ids: ``moe_layers``, or
        every layer from ``first_dense`` on) of the model every check uses."""
        return ModelShape()

    @pytest.fixture(scope="class")
    @classmethod
    def aborted_samples(cls) -> tuple[int, ...]:
        """Rollout samples whose engine call was aborted (``routes=None``: their tokens train,
        routed natively), in the ingest checks' six samples and the Megatron checks' eight
        (:data:`~r3bridge.testing.kit.conformance.GROUPS`: ``(4, 5)`` makes micro-batch 2 one whose
        samples were all aborted). Default none."""
        return ()

    @pytest.fixture(scope="class")
    @classmethod
    def single_call(cls) -> bool:
        """One engine call per sample in every check's rollouts (a framework whose samples are one
        request each: no multi-turn prefill, no resubmit). Default ``False``: multi-call rollouts,
        which a framework that stitches several calls per sample must pass."""
        return False

    @pytest.fixture(params=[0, 1, 2], ids=lambda s: f"seed{s}")
    def rollout_seed(self, request: Any) -> int:
        return request.param

    @pytest.fixture
    def rollout(self, rollout_seed: int, model_shape: ModelShape, aborted_samples: Sequence[int],
                single_call: bool) -> CanonicalRollout:
        """Six samples: single- and multi-turn (``single_call``: single only), a resubmit,
        untracked tails, ``aborted_samples``."""
        return model_shape.rollout(rollout_seed, batch_size=6, aborted=tuple(aborted_samples), single_call=single_call)

    @pytest.fixture
    def recorded(self, rollout: CanonicalRollout) -> ReplayBatch:
        """R2 routes of the rollout's samples (check 2)."""
        return kit.random_recorded(rollout)

    @pytest.fixture
    def split_parts(self) -> Sequence[int]:
        """How many parts check 2 asks ``codec.split`` for."""
        return (1, 2, 4)

    @pytest.fixture
    def split_orders(self, rollout: CanonicalRollout) -> Sequence[Optional[list[int]]]:
        """Sample orders check 2 splits in (None: the batch's own), a shuffle included."""
        n = rollout.batch_size
        return (None, [(3 * i + 2) % n for i in range(n)] if n % 3 else list(reversed(range(n))))

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_model_spec(cls, model_shape: ModelShape) -> Any:
        """The harness :class:`~r3bridge.testing.harness.models.ModelSpec` of checks 4-5."""
        return model_shape.model_spec()

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_layouts(cls) -> Sequence[tuple[int, Any]]:
        """``(world_size, Layout)`` pairs of checks 4-5: 1 rank, then TP2 + SP, CP2 and PP2 x VPP2
        (:data:`r3bridge.testing.kit.conformance.CPU_LAYOUTS`; ``GPU_LAYOUTS`` on GPU machines),
        fitted to ``model_shape`` before anything runs (:func:`~r3bridge.testing.kit.conformance.fit_layouts`:
        a VPP split the layer count does not allow is replaced, a :class:`LayoutNote` says so)."""
        return kit.CPU_LAYOUTS

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_extras(cls) -> Any:
        """Optional picklable ``(ctx, runners) -> result`` run on every rank after checks 4-5
        (framework-specific follow-ups); its result is ``rank["extras"]``."""
        return None

    @pytest.fixture(scope="class")
    @classmethod
    def min_coverage(cls) -> float:
        return kit.MIN_COVERAGE

    @pytest.fixture(scope="class")
    @classmethod
    def reader_form(cls) -> Optional[str]:
        """What the adapter hands the driver per micro-batch, as ``"<form>/<no route>"`` of
        :class:`r3bridge.parallel.handed.HandedRoutes` (e.g. ``"packed/zero"``; None: any)."""
        return None


class BaseIngestTests:
    """Checks 1-3 (no Megatron): combine with an :class:`AdapterFixtures` subclass."""

    def test_check1_ingest(self, codec: Any, native_batch: Any, rollout: CanonicalRollout) -> None:
        kit.check_ingest(codec, native_batch, rollout, type(codec).__name__)

    def test_check2_recorded_survives_split(self, codec: Any, native_batch: Any, recorded: ReplayBatch,
                                            split_parts: Sequence[int], split_orders: Sequence) -> None:
        checked = kit.check_recorded_survives_split(codec, native_batch, recorded, parts=split_parts,
                                                    orders=split_orders)
        assert checked >= len(split_parts) * len(split_orders)

    def test_check3_same_targets(self, codec: Any, native_batch: Any, rollout: CanonicalRollout,
                                 model_shape: ModelShape) -> None:
        read = codec.to_replay_batch(native_batch, route_kind="rollout")
        kit.check_same_targets({type(codec).__name__: read, "canonical": rollout.expected()},
                               [len(t) for t in rollout.tokens], layouts=kit.default_layouts(model_shape))


class BaseMegatronTests:
    """Checks 4-5 on the CPU Megatron harness: combine with an :class:`AdapterFixtures` subclass.
    Both tests share one run per world size (``megatron_results``)."""

    @pytest.fixture(scope="class")
    @classmethod
    def megatron_results(cls, megatron_runner: Any, model_shape: ModelShape, megatron_model_spec: Any,
                         megatron_layouts: Sequence, megatron_extras: Any,
                         aborted_samples: Sequence[int], single_call: bool) -> list[kit.LayoutResult]:
        case = kit.MegatronCase(megatron_runner, shape=model_shape, spec=megatron_model_spec,
                                extras=megatron_extras, aborted=tuple(aborted_samples), single_call=single_call)
        return kit.run_megatron_checks(case, megatron_layouts)

    def test_check4_r3_dispatches_canonical_routes(self, megatron_results: list, min_coverage: float) -> None:
        for result in megatron_results:
            kit.assert_r3_passes(result, min_coverage=min_coverage)

    def test_check4_routes_read_once_per_micro_batch(self, megatron_results: list, reader_form: Any) -> None:
        for result in megatron_results:
            kit.assert_read_once_per_micro_batch(result, form=reader_form)

    def test_check5_r2_replay_reproduces_recording(self, megatron_results: list) -> None:
        for result in megatron_results:
            kit.assert_r2_passes(result)
