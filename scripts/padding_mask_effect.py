"""What rows without a route do to megatron's router statistics, with and without r3bridge's mask.

    python scripts/padding_mask_effect.py [--json OUT]      # CPU, one gloo rank, any megatron-core 0.16-0.19

One R3 training step of a MoE-only model (tests/megatron/stats_checks.py) on a packed
micro-batch whose rows without a route are packing padding (sequences padded to a multiple of 64,
as a CP/FP8 packer does) plus every 5th row (engine rows missing). Reported per MoE layer:
aux loss and z-loss with the mask (r3bridge's default) and without (``mask_unrouted_rows=False``),
and, for a router with expert bias (never masked: megatron's ``_apply_expert_bias`` cannot take a
padding mask), how far its token counts are from the counts over routed rows only.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# the stats scenario is one of r3bridge's own tests (tests/megatron); the spawned rank inherits sys.path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "megatron"))

SEQ_LENS = [190, 75, 310, 41]
ALIGN = 64


def main() -> int:
    from stats_checks import run_stats_checks

    from r3bridge.megatron.compat import megatron_version
    from r3bridge.testing.harness.dist import spawn

    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    a = p.parse_args()
    pad_to = sum(-(-n // ALIGN) * ALIGN for n in SEQ_LENS)
    spec_kw = dict(num_layers=4, hidden_size=64, ffn_hidden_size=64, num_moe_experts=8, moe_router_topk=2,
                   max_sequence_length=1024)
    res = spawn(run_stats_checks, world_size=1, args=(SEQ_LENS, pad_to, 5, spec_kw), timeout=900)[0]
    on, off, eb = res[(True, False)], res[(False, False)], res["expert_bias"]
    layers = []
    for lid in sorted(on["expected_routed_counts"]):
        routed = eb["expected_routed_counts"][lid]
        counted = eb["tokens_per_expert"][lid]
        layers.append({
            "layer": lid,
            "aux_loss_masked": on["aux_loss"][lid], "aux_loss_unmasked": off["aux_loss"][lid],
            "aux_loss_rel_diff": (off["aux_loss"][lid] - on["aux_loss"][lid]) / on["aux_loss"][lid],
            "z_loss_masked": on["z_loss"][lid], "z_loss_unmasked": off["z_loss"][lid],
            "z_loss_rel_diff": (off["z_loss"][lid] - on["z_loss"][lid]) / on["z_loss"][lid],
            "expert_bias_counts": counted, "routed_row_counts": routed,
            "expert_bias_counts_extra_fraction": (sum(counted) - sum(routed)) / sum(routed),
        })
    out = {"megatron_core": ".".join(map(str, megatron_version())), "seq_lens": SEQ_LENS, "packed_rows": on["rows"],
           "routed_rows": on["routed_rows"], "unrouted_fraction": 1 - on["routed_rows"] / on["rows"],
           "stats_unmasked_calls_with_expert_bias": eb["metrics"].get("r3bridge/stats_unmasked_calls"),
           "layers": layers}
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
