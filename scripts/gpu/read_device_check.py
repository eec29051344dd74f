"""The one reader's device path equals its host path: ``rank_targets`` on ``cuda`` vs ``cpu``.

The CPU suite tests the read on the host (its sorting-network check); on a GPU the check, the
fillers and the int64 widening run on the device (min / max and a sort of the K ids, one mask
copy). This compares both, on every rank of TP2 x CP2 x PP2 (SP on), for clean routes, routes with
weights, a repeated id routed natively and refused, and an id out of range: same targets, masks,
weights, counts, and the same error class and message. Exit status 1 on any difference.

    python scripts/gpu/read_device_check.py        # on a machine with a GPU
"""
from __future__ import annotations

import sys

import numpy as np
import torch

import r3bridge

L, K, E = 6, 4, 16


def engine_arrays(lens, seed):
    rng = np.random.default_rng(seed)
    return [np.stack([rng.permutation(E)[:K] for _ in range((n - 1) * L)]).reshape(n - 1, L, K).astype(np.int16)
            for n in lens]


def read(items, lens, lay, dev, *, tp, cp, pp, **kw):
    try:
        t = r3bridge.rank_targets(items, lay, lens, num_experts=E, tp_rank=tp, cp_rank=cp, pp_rank=pp, device=dev,
                                  **kw)
    except r3bridge.ReplayError as e:
        return ("error", type(e).__name__, str(e))
    w = None if t.weights is None else {k: v.cpu() for k, v in t.weights.items()}
    return ({k: v.cpu() for k, v in t.indices.items()}, t.valid.cpu(), t.num_valid, w)


def same(a, b) -> bool:
    if isinstance(a, tuple) and a and a[0] == "error":
        return a == b
    ia, va, na, wa = a
    ib, vb, nb, wb = b
    return (ia.keys() == ib.keys() and all(torch.equal(ia[k], ib[k]) for k in ia) and torch.equal(va, vb)
            and na == nb and (wa is None) == (wb is None)
            and (wa is None or all(torch.equal(wa[k], wb[k]) for k in wa)))


def main() -> int:
    if not torch.cuda.is_available():
        print("error: no GPU here", file=sys.stderr)
        return 2
    lay = r3bridge.ParallelLayout(L, tuple([1] * L), tp=2, cp=2, pp=2, ep=2, sequence_parallel=True)
    lens = [37, 64, 5, 130]
    clean = engine_arrays(lens, 0)
    dup = [a.copy() for a in clean]
    dup[1][7, 4, 1] = dup[1][7, 4, 0]                 # sample 1, row 7, layer 4: a repeated id
    bad = [a.copy() for a in clean]
    bad[3][100, 3, 2] = E                              # sample 3, row 100, layer 3: out of range
    rng = np.random.default_rng(1)
    weights = [rng.random((n - 1, L, K)).astype(np.float32) for n in lens]
    cases = {"clean": (clean, {}), "weights": (clean, {"weights": weights}),
             "repeat native": (dup, {"degenerate": "native"}), "repeat refused": (dup, {}),
             "out of range": (bad, {})}
    failures, checked = [], 0
    for name, (items, kw) in cases.items():
        for tp in range(2):
            for cp in range(2):
                for pp in range(2):
                    host = read(items, lens, lay, "cpu", tp=tp, cp=cp, pp=pp, **kw)
                    dev = read(items, lens, lay, "cuda", tp=tp, cp=cp, pp=pp, **kw)
                    checked += 1
                    if not same(host, dev):
                        failures.append(f"{name} (tp {tp}, cp {cp}, pp {pp}): host {str(host)[:200]} != "
                                        f"device {str(dev)[:200]}")
    errors = sum(1 for name, (items, kw) in cases.items() if name in ("repeat refused", "out of range"))
    print(f"{checked} reads compared ({len(cases)} cases x 8 ranks; {errors} cases raise on the ranks that "
          f"read the bad row), {len(failures)} differ on {torch.cuda.get_device_name()}")
    for f in failures:
        print("  " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
