"""Routes by reference (r3bridge.handles): a rank reading its rows and stage layers through route
handles gets exactly the targets ``r3bridge.shard`` gives for the same routes, over TP / SP / CP /
PP / VPP layouts and every store; a missing, truncated or altered object is refused naming the
sample; handles of another run or step are refused; a step's routes are released when it ends."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import r3bridge
from r3bridge.errors import CoverageError, LayerMappingError
from r3bridge.handles import (
    FileRoutes,
    HandleReads,
    KeyValueRoutes,
    LocalKeyValue,
    RouteHandle,
    RouteHandleError,
    RouteStore,
    read_rank_targets,
    resolve,
)
from r3bridge.handles.handle import DIGEST_KIND, layer_digests

NUM_LAYERS, MOE = 8, [0, 1, 1, 1, 1, 1, 1, 1]
MOE_IDS = [i for i, m in enumerate(MOE) if m]
E, K = 16, 3

LAYOUTS = [
    dict(),
    dict(tp=2),
    dict(tp=2, sequence_parallel=False),
    dict(cp=2),
    dict(tp=2, cp=2),
    dict(pp=2),
    dict(pp=2, vpp=2),
    dict(tp=2, cp=2, pp=2, vpp=2),
    dict(tp=4, cp=2, pp=4),
]


def _ranks(layout):
    for tp in range(layout.tp):
        for cp in range(layout.cp):
            for pp in range(layout.pp):
                for vp in range(layout.vpp or 1):
                    yield dict(tp_rank=tp, cp_rank=cp, pp_rank=pp, vp_stage=vp)


def _samples(seed, n=6, dtype=np.uint8):
    """(routes [rows, L, K], start row, trainer's seq_len) per sample: starts past 0, a final token
    without a route or not, an aborted sample (no rows)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        rows = 0 if i == 3 else int(rng.integers(5, 90))
        start = int(rng.integers(0, 6)) if i % 2 else 0
        r = np.argsort(rng.random((rows, len(MOE_IDS), E)), axis=-1)[..., :K].astype(dtype)
        out.append((r, start, start + rows + int(rng.integers(0, 2))) if rows else (r, 4, 4))
    return out


def _batch(samples):
    return r3bridge.ReplayBatch.from_ragged([s[0] for s in samples], num_experts=E, layer_ids=MOE_IDS,
                                            start_rows=[s[1] for s in samples])


def _store(tmp_path, kind, **kw):
    backend = FileRoutes(str(tmp_path / "routes")) if kind == "files" else KeyValueRoutes(LocalKeyValue())
    return RouteStore(backend, **kw)


def _put(store, samples, step=0):
    return [store.put(f"s{i}", r, MOE_IDS, start, step=step, num_experts=E)
            for i, (r, start, _) in enumerate(samples)]


def _same(a, b):
    assert a.layer_ids == b.layer_ids
    assert torch.equal(a.valid, b.valid)
    for lid in a.layer_ids:
        assert torch.equal(a.indices[lid], b.indices[lid]), lid


@pytest.mark.parametrize("spec", LAYOUTS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()) or "single")
@pytest.mark.parametrize("kind", ["files", "kv"])
def test_rank_read_equals_shard(tmp_path, spec, kind):
    layout = r3bridge.ParallelLayout(NUM_LAYERS, MOE, **spec)
    samples = _samples(len(LAYOUTS) + len(spec), dtype=np.int16 if kind == "kv" else np.uint8)
    lens = [s[2] for s in samples]
    rb = _batch(samples)
    store = _store(tmp_path, kind, block_rows=8)
    handles = _put(store, samples)
    resolvers = {store.name: store.backend}
    for ranks in _ranks(layout):
        want = r3bridge.shard(rb, layout, lens, **ranks)
        stats = HandleReads()
        got = read_rank_targets(handles, resolvers, layout, lens, run_id=store.run_id, step=0, stats=stats, **ranks)
        _same(got, want)
        assert stats.bytes_read <= stats.bytes_whole
    if layout.pp * layout.cp * layout.tp >= 4:
        # a rank of several reads a fraction of the routes (whole digest blocks of its rows, its layers)
        assert stats.bytes_read < stats.bytes_whole / 2


def test_resolve_and_handle_forms(tmp_path):
    samples = _samples(1)
    store = _store(tmp_path, "files", block_rows=16)
    handles = _put(store, samples)
    r = samples[0][0]
    resolvers = {store.name: store.backend}
    assert np.array_equal(resolve(handles[0], resolvers), r)
    assert np.array_equal(resolve(handles[0], resolvers, slice(3, 20), [3, 5]), r[3:20, [2, 4]])
    h = handles[0]
    text = h.to_json()
    assert len(text) < 400 and len(pickle.dumps(h)) < 600
    assert RouteHandle.from_json(text) == h
    with pytest.raises(RouteHandleError, match="not a route handle"):
        RouteHandle.from_json('{"store": "files"}')
    # a handle written before the digest kind was named (crc32 blocks), as JSON or pickled: refused by
    # name, never compared against this version's digests
    assert h.digest_kind == DIGEST_KIND
    old = json.loads(text)
    old.pop("digest_kind")
    legacy = RouteHandle.from_json(json.dumps(old))
    unkinded = dataclasses.replace(h)
    object.__delattr__(unkinded, "digest_kind")          # what unpickling an older version's handle gives
    for old_handle in (legacy, pickle.loads(pickle.dumps(unkinded))):
        assert old_handle.digest_kind == "crc32"
        with pytest.raises(RouteHandleError, match=r"sample 's0'.*digests are 'crc32'.*this reader checks 'wsum64'"):
            resolve(old_handle, resolvers)
    # an older version's file (format R3RH0001) under a current handle: refused by its format
    path = Path(store.backend.path(h.key))
    raw = path.read_bytes()
    path.write_bytes(b"R3RH0001" + raw[8:])
    with pytest.raises(RouteHandleError, match=r"sample 's0'.*not an r3bridge route file of format R3RH0002"):
        resolve(h, resolvers)


@pytest.mark.parametrize("rows,topk,dtype,block_rows", [(1000, 22, np.int16, 256), (37, 3, np.int16, 8),
                                                        (29, 3, np.int8, 5), (300, 1, np.uint8, 3)])
def test_block_digest_sees_every_single_change_and_swap(rows, topk, dtype, block_rows):
    """Each block's digest changes when any one id in it changes (by one, or in its top bit) or two
    unequal ids in it swap, and no other block's does; whole words and padded ones (a short last
    block, blocks of odd byte counts) alike."""
    rng = np.random.default_rng(rows)
    layer = rng.integers(0, 100, (rows, topk)).astype(dtype)
    want = layer_digests(layer, block_rows)
    assert want.shape == (-(-rows // block_rows),) and want.dtype == np.uint64
    top = np.array(np.iinfo(dtype).min if np.iinfo(dtype).min else np.iinfo(dtype).max // 2 + 1, dtype=dtype)
    for r in range(rows):
        for c in range(topk):
            for changed in (layer[r, c] + 1, layer[r, c] ^ top):
                other = layer.copy()
                other[r, c] = changed
                got = layer_digests(other, block_rows)
                assert np.flatnonzero(got != want).tolist() == [r // block_rows], (r, c)
    for r in range(0, rows, max(1, rows // 50)):
        other = layer.copy()
        r2 = min(rows - 1, (r // block_rows) * block_rows + block_rows - 1)
        other[r, 0], other[r2, topk - 1] = layer[r2, topk - 1], layer[r, 0]
        if layer[r, 0] != layer[r2, topk - 1]:
            assert np.flatnonzero(layer_digests(other, block_rows) != want).tolist() == [r // block_rows]


def test_template_rollout_writes_stitched_routes(tmp_path):
    """The template adapter's rollout path stores each sample's first-seen stitched routes once;
    ranks read them back exactly as the canonical (inline) routes."""
    from r3bridge.adapters._template import TemplateRollout
    from r3bridge.testing.kit.rollouts import make_rollout

    ro = make_rollout(3, batch_size=6, num_experts=E, topk=K, num_layers=NUM_LAYERS, moe_layer_ids=MOE_IDS,
                      aborted=(4,))
    store = _store(tmp_path, "files", block_rows=4)
    handles = TemplateRollout(num_experts=E, moe_layer_ids=MOE_IDS, topk=K).handles_from_rollout(
        ro.calls, store, [f"traj-{i}" for i in range(ro.batch_size)], step=7)
    assert [h.sample for h in handles] == [f"traj-{i}" for i in range(ro.batch_size)] and handles[4].rows == 0
    lens = [len(t) for t in ro.tokens]
    expected = ro.expected()
    for spec in (dict(tp=2, cp=2, pp=2), dict(pp=2, vpp=2)):
        layout = r3bridge.ParallelLayout(NUM_LAYERS, MOE, **spec)
        for ranks in _ranks(layout):
            got = read_rank_targets(handles, {store.name: store.backend}, layout, lens, run_id=store.run_id, step=7,
                                    **ranks)
            _same(got, r3bridge.shard(expected, layout, lens, **ranks))


@pytest.mark.parametrize("kind", ["files", "kv"])
def test_missing_truncated_or_altered_routes_fail_closed(tmp_path, kind):
    samples = _samples(2)
    lens = [s[2] for s in samples]
    layout = r3bridge.ParallelLayout(NUM_LAYERS, MOE, pp=2)
    store = _store(tmp_path, kind, block_rows=8)
    handles = _put(store, samples)
    resolvers = {store.name: store.backend}
    stage1 = layout.moe_layers(1)

    def read():
        return read_rank_targets(handles, resolvers, layout, lens, run_id=store.run_id, step=0, pp_rank=1)

    victim = handles[2]
    pos = victim.layer_ids.index(stage1[0])
    if kind == "files":
        path = Path(store.backend.path(victim.key))
        raw = bytearray(path.read_bytes())
        data0 = len(raw) - victim.nbytes
        layer0 = data0 + victim.layer_ids.index(MOE_IDS[0]) * victim.rows * K   # a layer stage 1 never reads
        raw[layer0] ^= 1
        path.write_bytes(bytes(raw))
        read()                                       # an unread block changed: nothing read is wrong
        raw[layer0] ^= 1
        raw[data0 + pos * victim.rows * K + 5 * K] ^= 1     # layer stage1[0], row 5
        path.write_bytes(bytes(raw))
        with pytest.raises(RouteHandleError, match=rf"sample 's2'.*layer {stage1[0]} rows 0-8 do not match"):
            read()
        path.write_bytes(bytes(raw[:-3]))
        with pytest.raises(RouteHandleError, match=r"sample 's2'.*truncated"):
            read()
        os.unlink(path)
    else:
        kv = store.backend.kv.values
        key = f"{victim.key}/layer/{pos}"
        good = kv[key]
        kv[key] = good[:-1]
        with pytest.raises(RouteHandleError, match=r"sample 's2'.*truncated"):
            read()
        kv[key] = bytes([good[0] ^ 1]) + good[1:]
        with pytest.raises(RouteHandleError, match=rf"sample 's2'.*layer {stage1[0]} rows 0-8 do not match"):
            read()
        del kv[key]
    with pytest.raises(RouteHandleError, match=r"sample 's2'.*(missing|no route file|no value)"):
        read()


def test_lifetime_release_and_foreign_handles(tmp_path):
    samples = _samples(4)
    lens = [s[2] for s in samples]
    layout = r3bridge.ParallelLayout(NUM_LAYERS, MOE, tp=2)
    store = _store(tmp_path, "files")
    resolvers = {store.name: store.backend}
    root = tmp_path / "routes"
    with pytest.raises(RuntimeError, match="the step crashed"):
        with store.step(3):
            crashed = _put(store, samples, step=3)
            raise RuntimeError("the step crashed")
    assert store.live_steps() == [] and not any(p.is_file() for p in root.rglob("*"))
    with pytest.raises(RouteHandleError, match=r"sample 's0'.*missing objects fail closed"):
        read_rank_targets(crashed, resolvers, layout, lens, run_id=store.run_id, step=3)
    handles = _put(store, samples, step=4)
    with pytest.raises(RouteHandleError, match="already stored for step 4"):
        _put(store, samples[:1], step=4)
    with pytest.raises(RouteHandleError, match=r"sample 's0'.*this read is for run .* step 5"):
        read_rank_targets(handles, resolvers, layout, lens, run_id=store.run_id, step=5)
    later = RouteStore(store.backend)               # another run, same directory
    with pytest.raises(RouteHandleError, match=r"sample 's0'.*another run"):
        read_rank_targets(handles, resolvers, layout, lens, run_id=later.run_id, step=4)
    with pytest.raises(RouteHandleError, match="no resolver for store 'files'"):
        read_rank_targets(handles, {}, layout, lens, run_id=store.run_id, step=4)
    with pytest.raises(LayerMappingError, match=r"sample 's0'.*needs MoE layers \[9\]"):
        read_rank_targets(handles, resolvers, layout, lens, run_id=store.run_id, step=4, layer_ids=[9])
    short = list(lens)
    short[0] = samples[0][1] + len(samples[0][0]) - 2
    with pytest.raises(CoverageError, match=r"sample 's0'.*ends past"):
        read_rank_targets(handles, resolvers, layout, short, run_id=store.run_id, step=4)
    assert store.live_bytes() == sum(h.nbytes for h in handles)
    assert store.release(4) == len(handles) and store.live_bytes() == 0
    assert not any(p.is_file() for p in root.rglob("*"))
    kept = _store(tmp_path, "files", keep=True)           # trace_dir set: kept for the traces
    with kept.step(1):
        kept_handles = _put(kept, samples, step=1)
    got = read_rank_targets(kept_handles, resolvers, layout, lens, run_id=kept.run_id, step=1)
    _same(got, r3bridge.shard(_batch(samples), layout, lens))


def test_ray_object_store(tmp_path):
    """Routes in Ray's object store, one object per sample (the default: one put, mapped zero-copy)
    and one per layer (a stage fetches only its layers): every rank's targets equal ``shard``'s; a
    handle whose digest does not match what Ray holds is refused; a released step's handles are
    refused by a later step's read (Ray frees the objects when the last handle is dropped)."""
    import dataclasses

    import ray

    from r3bridge.handles import RayRoutes

    ray.init(num_cpus=1, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False,
             configure_logging=False)
    try:
        samples = _samples(5)
        lens = [s[2] for s in samples]
        layout = r3bridge.ParallelLayout(NUM_LAYERS, MOE, tp=2, cp=2, pp=2)
        rb = _batch(samples)
        for per_layer in (False, True):
            store = RouteStore(RayRoutes(per_layer=per_layer), block_rows=16)
            handles = _put(store, samples, step=2)
            assert len(pickle.dumps(handles[0])) < 800
            handles = pickle.loads(pickle.dumps(handles))          # as they travel in a batch
            stored = ray.get(handles[0].ref)[1]
            assert (isinstance(stored, list) and len(stored) == len(MOE_IDS)) == per_layer
            resolvers = {"ray": store.backend}
            for ranks in _ranks(layout):
                got = read_rank_targets(handles, resolvers, layout, lens, run_id=store.run_id, step=2, **ranks)
                _same(got, r3bridge.shard(rb, layout, lens, **ranks))
            forged = [dataclasses.replace(handles[0], digest=handles[0].digest ^ 1)] + handles[1:]
            with pytest.raises(RouteHandleError, match=r"sample 's0'.*digest table does not match"):
                read_rank_targets(forged, resolvers, layout, lens, run_id=store.run_id, step=2)
            store.release(2)
            with pytest.raises(RouteHandleError, match=r"sample 's0'.*step 3"):
                read_rank_targets(handles, resolvers, layout, lens, run_id=store.run_id, step=3)
    finally:
        ray.shutdown()


def test_route_transport_setting():
    from r3bridge.config import ReplayConfig
    from r3bridge.errors import ConfigError

    assert ReplayConfig().route_transport == "inline"                       # off by default
    assert ReplayConfig.from_mapping({"route_transport": "handles"}).route_transport == "handles"
    with pytest.raises(ConfigError, match="route_transport must be one of inline, handles, got 'bytes'"):
        ReplayConfig(route_transport="bytes")


def test_recorded_routes_by_reference_and_flat_over_steps(tmp_path):
    """R2's recorded routes are stored the same way (route kind kept, read back as shard reads
    them); over many steps each released step leaves nothing behind."""
    samples = _samples(6)
    lens = [s[2] for s in samples]
    recorded = r3bridge.ReplayBatch.from_ragged([s[0] for s in samples], num_experts=E, layer_ids=MOE_IDS,
                                                start_rows=[s[1] for s in samples], route_kind="recorded")
    layout = r3bridge.ParallelLayout(NUM_LAYERS, MOE, tp=2, cp=2, pp=2)
    store = _store(tmp_path, "files", block_rows=8)
    root = tmp_path / "routes"
    for step in range(60):
        with store.step(step):
            handles = store.put_batch(recorded, [f"s{i}" for i in range(len(samples))], step=step)
            assert {h.route_kind for h in handles} == {"recorded"}
            if step % 20 == 0:
                for ranks in _ranks(layout):
                    got = read_rank_targets(handles, {"files": store.backend}, layout, lens, run_id=store.run_id,
                                            step=step, **ranks)
                    _same(got, r3bridge.shard(recorded, layout, lens, **ranks))
        assert store.live_steps() == [] and store.live_bytes() == 0
        assert not any(root.rglob("*.routes")) and not any(root.rglob("*.part"))


@pytest.mark.parametrize("read", [dict(format="bshd", seq_length=96), dict(cu_seqlens_padded="trainer")],
                         ids=["bshd", "cu_seqlens_padded"])
def test_rank_read_follows_the_trainers_packing(tmp_path, read):
    """The trainer's own packing (BSHD, or THD with its padded cu_seqlens) reaches the handles' read
    as it reaches shard."""
    layout = r3bridge.ParallelLayout(NUM_LAYERS, MOE, tp=2, cp=2, pp=2)
    samples = _samples(9)
    lens = [s[2] for s in samples]
    if read.get("cu_seqlens_padded") == "trainer":      # each sequence padded to 16 (more than tp * cp * 2)
        padded = [-(-n // 16) * 16 for n in lens]
        read = dict(cu_seqlens_padded=np.concatenate([[0], np.cumsum(padded)]).tolist())
    store = _store(tmp_path, "files", block_rows=8)
    handles = _put(store, samples)
    rb = _batch(samples)
    for ranks in _ranks(layout):
        got = read_rank_targets(handles, {"files": store.backend}, layout, lens, run_id=store.run_id, step=0,
                                **read, **ranks)
        _same(got, r3bridge.shard(rb, layout, lens, **read, **ranks))


def test_opened_handles_hold_no_file_descriptor(tmp_path):
    """A pass keeps every micro-batch's handed routes until it ends: an opened handle must not hold
    a file (or a mapping's descriptor) open."""
    from r3bridge.handles import handed_routes
    from r3bridge.parallel.rank_rows import RankRows
    from r3bridge.parallel.read import read_targets

    samples = _samples(11, n=12)
    lens = [s[2] for s in samples]
    layout = r3bridge.ParallelLayout(NUM_LAYERS, MOE)
    store = _store(tmp_path, "files")
    handles = _put(store, samples)
    fds = len(os.listdir("/proc/self/fd"))
    kept = []
    for _ in range(3):
        routes = handed_routes(handles, {"files": store.backend}, lens, run_id=store.run_id, step=0)
        rows = RankRows.build(layout, lens, tp_rank=0, cp_rank=0).cover(routes)
        got = read_targets(routes, rows, MOE_IDS)
        kept.append(routes)
    _same(got, r3bridge.shard(_batch(samples), layout, lens))
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_killed_runs_files_are_swept(tmp_path):
    """A run killed mid-step (no release) leaves its files; a later run never reads them and can
    sweep them (they hold memory under /dev/shm)."""
    samples = _samples(12)
    backend = FileRoutes(str(tmp_path / "routes"))
    killed = RouteStore(backend)
    old = _put(killed, samples, step=9)                       # never released: the process died
    for p in (tmp_path / "routes").rglob("*.routes"):
        os.utime(p, (1, 1))
    later = RouteStore(backend)
    fresh = _put(later, samples, step=0)
    with pytest.raises(RouteHandleError, match="another run"):
        read_rank_targets(old, {"files": backend}, r3bridge.ParallelLayout(NUM_LAYERS, MOE), [s[2] for s in samples],
                          run_id=later.run_id, step=0)
    assert backend.remove_stale_runs(3600, keep=[later.run_id]) == [killed.run_id]
    assert not (tmp_path / "routes" / killed.run_id).exists()
    assert resolve(fresh[0], {"files": backend}).shape == samples[0][0].shape


def test_an_adapter_that_reads_no_handles_refuses_route_transport_handles():
    """``route_transport: handles`` where the adapter's micro-batch read takes the inline bytes
    (verl, SkyRL and AReaL today) would leave the job on the inline routes silently: the session
    refuses it, naming the setting; an adapter that declares it reads handles gets its session."""
    from r3bridge.errors import ConfigError
    from r3bridge.session import AdapterSession

    cfg = {"replay_mode": "R3", "route_transport": "handles"}
    for framework in ("verl", "skyrl", "areal"):
        with pytest.raises(ConfigError, match=rf"route_transport='handles': the {framework} adapter reads routes as "
                                              r"inline only"):
            AdapterSession(framework, cfg, where=None)
    assert AdapterSession("template", cfg, where=None, route_transports=("inline", "handles")).mode.value == "R3"


def test_put_many_on_threads_writes_what_put_writes_or_nothing(tmp_path):
    """``put_many`` on 4 threads stores byte-for-byte what one ``put`` per sample stores, in entry
    order; a duplicate name is refused before any write, and a failing write deletes the call's
    other writes (all or nothing)."""
    from r3bridge.handles import SampleRoutes

    samples = [s for s in _samples(5, n=8) if s[0].shape[0]]
    entries = [SampleRoutes(f"s{i}", r, MOE_IDS, start, E) for i, (r, start, _) in enumerate(samples)]
    serial = RouteStore(FileRoutes(str(tmp_path / "serial")), run_id="run")
    threaded = RouteStore(FileRoutes(str(tmp_path / "threaded")), run_id="run", workers=4)
    one = [serial.put(e.sample, e.routes, e.layer_ids, e.start_row, step=1, num_experts=E) for e in entries]
    many = threaded.put_many(entries, step=1)
    assert [h.sample for h in many] == [e.sample for e in entries] and many == one    # same keys, shapes, digests
    for h in many:
        assert Path(threaded.backend.path(h.key)).read_bytes() == Path(serial.backend.path(h.key)).read_bytes()

    with pytest.raises(RouteHandleError, match="'s0': already stored for step 1"):
        threaded.put_many([SampleRoutes("new", *entries[0][1:]), entries[0]], step=1)
    assert not os.path.exists(threaded.backend.path("run/1/new"))                   # checked before writing

    class FailsOnThird(FileRoutes):
        def write(self, key, routes, block_rows, times=None):
            if key.endswith("/t2"):
                raise OSError("disk full")
            return super().write(key, routes, block_rows, times)

    store = RouteStore(FailsOnThird(str(tmp_path / "failing")), run_id="run", workers=4)
    with pytest.raises(OSError, match="disk full"):
        store.put_many([SampleRoutes(f"t{i}", *e[1:]) for i, e in enumerate(entries)], step=2)
    assert store.live_steps() == [] and not list((tmp_path / "failing").rglob("*.routes"))
