"""Shared test data: verl 0.9.1 batches built the way its agent loop and trainer build them
(padded ``[B, S, ...]`` fields, then verl's own ``left_right_2_no_padding``)."""
from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict
from verl.workers.utils.padding import left_right_2_no_padding

from r3bridge.adapters.verl.codec import ROUTES_KEY
from r3bridge.testing.kit.conformance import CanonicalRollout

E, K = 8, 2
NUM_LAYERS = 4
MOE = [1, 2, 3]                  # first_k_dense_replace = 1


def _engine_routes(rng, rows: int) -> np.ndarray:
    """What vLLM returns for one sample: [rows, num_hidden_layers, K], dense layer 0 all zero."""
    out = np.zeros((rows, NUM_LAYERS, K), dtype=np.int16)
    for r in range(rows):
        for l in MOE:
            out[r, l] = rng.choice(E, size=K, replace=False)
    return out


def make_verl_batch(prompt_lens, resp_lens, returned_rows=None, seed=0, P=6, R=5):
    """Padded verl batch + the per-sample engine arrays it was built from."""
    rng = np.random.default_rng(seed)
    b = len(prompt_lens)
    S = P + R
    input_ids = torch.zeros(b, S, dtype=torch.long)
    attn = torch.zeros(b, S, dtype=torch.long)
    resp_mask = torch.zeros(b, R, dtype=torch.long)
    routes = torch.zeros(b, S, NUM_LAYERS, K, dtype=torch.int16)
    engine = []
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        start = P - p
        attn[i, start:P + r] = 1
        input_ids[i, start:P + r] = torch.arange(1, p + r + 1)
        resp_mask[i, :r] = 1
        n = p + r - 1 if returned_rows is None or returned_rows[i] is None else returned_rows[i]
        arr = _engine_routes(rng, n)
        engine.append(arr)
        routes[i, start:start + n] = torch.from_numpy(arr)     # verl agent_loop: routed_experts[:, start:end]
    position_ids = torch.clamp(attn.cumsum(-1) - 1, min=0)
    td = TensorDict({"input_ids": input_ids, "attention_mask": attn, "response_mask": resp_mask,
                     "position_ids": position_ids, "prompts": input_ids[:, :P], "responses": input_ids[:, P:],
                     ROUTES_KEY: routes}, batch_size=[b])
    return left_right_2_no_padding(td), engine


def verl_batch(rollout: CanonicalRollout):
    """A canonical rollout as verl's trainer holds it (``testlab.verl_job.padded_fields``),
    through verl's ``left_right_2_no_padding``."""
    from testlab.verl_job import padded_fields

    fields = padded_fields(rollout)
    return left_right_2_no_padding(TensorDict(fields, batch_size=[rollout.batch_size]))
