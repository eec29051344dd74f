"""AReaL 1.0.4's own rollout path against a real SGLang server (``areal_actor.py --rollout sglang``;
tests and device scripts only).

* :func:`write_model` - the tiny Qwen3-MoE folder SGLang serves: ``config.json`` + bf16 weights
  drawn from (seed, parameter name) (:func:`r3bridge.demo.hf_engine.build_hf_model`), and a word-level
  tokenizer with a chat template in ``tokenizer/`` (AReaL's ``MultiTurnWorkflow`` applies it; the
  server runs on token ids with ``--skip-tokenizer-init``). The actor builds its model from the same
  config (its weights are the harness's: its layers are MoE-only, identity attention). Every layer is MoE: SGLang 0.5.12 runs a
  checkpoint's dense layers as MoE layers (docs/gpu-results/sglang-0.5.12/README.md).
* :func:`server_command` / :class:`SGLangServer` - ``python -m sglang.launch_server`` with
  ``--enable-return-routed-experts``, triton attention, pytorch sampling, the radix cache on, as a
  subprocess: a readiness wait on ``/health`` with a hard timeout, failing fast with the server's
  log tail; its process group killed at the end.
* :func:`run_rollout` - AReaL's ``RemoteSGLangEngine`` (with r3bridge's ``SGLangEngineMixin``)
  initialised on the server's address, AReaL's ``MultiTurnWorkflow`` (with ``WorkflowMixin``) run
  by AReaL's ``WorkflowExecutor`` (``submit`` / ``wait``); mid-rollout AReaL's interruption as its
  weight update does it (``pause`` + ``pause_generation``, then ``continue_generation`` +
  ``resume``): the requests in flight come back aborted and AReaL's client resubmits them (its
  attempts). Every attempt's request and response is recorded at AReaL's ``SGLangBackend``.
* :class:`RecordedRollout` - the trajectories for the actor, and the routes they must replay,
  rebuilt from the recorded responses independently of r3bridge's adapter (:meth:`expected`);
  :meth:`checks` compares them with what the adapter put into the trajectories (the multi-turn /
  resubmit stitching) and counts the rows SGLang served from cached prefixes.
"""
from __future__ import annotations

import base64
import contextvars
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from testlab.areal_env import import_areal

__all__ = ["MODEL", "write_model", "tiny_tokenizer", "server_command", "SGLangServer", "run_rollout",
           "RecordedRollout", "turns_reward", "free_port"]

# 4 layers, every one MoE (SGLang 0.5.12 runs dense layers as MoE), 8 experts top-2; head_dim 64
# (SGLang's triton attention kernels), vocab 128 (the tokenizer's words + specials)
MODEL = dict(num_layers=4, dense=(), num_experts=8, topk=2, vocab=128, max_positions=1024, head_dim=64)
SPECIALS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
ROUTER_STD = 0.5        # clear top-k margins, as scripts/gpu/sglang_routes.py
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hf_config() -> Any:
    from testlab.mbridge_spec import tiny_qwen3_moe

    return tiny_qwen3_moe(**MODEL)


def tiny_tokenizer(vocab: int = MODEL["vocab"]) -> Any:
    """A word-level fast tokenizer over ``vocab`` ids (specials first, then words ``w5``...), with a
    chat template: what ``MultiTurnWorkflow`` needs (``apply_chat_template``, ``decode``,
    ``eos_token_id``, ``pad_token_id``). No hub, no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + ["user", "assistant", "system"]
    words += [f"w{i}" for i in range(vocab - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|endoftext|>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_checkpoint(path: str, seed: int = 7) -> None:
    """``config.json`` + bf16 safetensors of :func:`hf_config`, weights from (seed, parameter name)."""
    import torch

    from r3bridge.demo.hf_engine import build_hf_model

    os.makedirs(path, exist_ok=True)
    build_hf_model(hf_config(), seed=seed, router_std=ROUTER_STD).to(torch.bfloat16).save_pretrained(
        path, safe_serialization=True)


def write_model(path: str, seed: int = 7, *, server_env: Optional[dict] = None) -> Any:
    """The folder SGLang serves: the checkpoint, written in the server's own environment when
    ``server_env`` is given (its transformers reads the config: SGLang 0.5.12 pins 5.6.0, the
    device image has 5.17, which names the expert count ``num_local_experts``), as
    scripts/gpu/sglang_routes.py wrote the one SGLang ran; the tokenizer (``tokenizer/``, read by
    AReaL's workflow here). Returns the HF config (the actor's model: the same config)."""
    if server_env is None:
        write_checkpoint(path, seed)
    else:
        env = dict(server_env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), _ROOT) if p)
        code = "import sys; from testlab.areal_sglang import write_checkpoint; write_checkpoint(sys.argv[1], int(sys.argv[2]))"
        proc = subprocess.run([sys.executable, "-c", code, path, str(seed)], env=env, cwd=_ROOT, capture_output=True,
                              text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"writing the checkpoint in the server's environment failed ({proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-4000:]}")
    tiny_tokenizer().save_pretrained(os.path.join(path, "tokenizer"))
    return hf_config()


# SGLang 0.5.12 derives its gRPC port as the HTTP port + 10000 and refuses one over 65535
# (server_args.py:1147-1154, `_handle_deprecated_args`): the device's first run drew 56167 from the
# kernel's ephemeral range and the server would not start. So the port is drawn below 55536, with its
# +10000 free too.
SGLANG_GRPC_OFFSET = 10000


def free_port(low: int = 20000, high: int = 65535 - SGLANG_GRPC_OFFSET, tries: int = 200) -> int:
    import random

    rng = random.Random()
    for _ in range(tries):
        port = rng.randrange(low, high + 1)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + SGLANG_GRPC_OFFSET))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free port pair (p, p + {SGLANG_GRPC_OFFSET}) with p in [{low}, {high}] after {tries} tries")


def server_command(model_dir: str, port: int, *, mem_fraction: float = 0.25, python: str = sys.executable,
                   module: str = "sglang.launch_server") -> list[str]:
    """The server's command line: the ``sglang.Engine`` options ``scripts/gpu/sglang_routes.py`` ran
    on the H200, as SGLang 0.5.12's own flags (each one checked in its ``server_args.py``), plus
    ``--disable-piecewise-cuda-graph`` (its capture was part of the 85 s first start; nothing here
    needs it). The radix cache stays on (AReaL's ``SGLangConfig`` turns it off by default): the
    multi-turn episodes' later turns are served from cached prefixes, which is what is checked.
    ``--log-level info``: the log in $OUT says what the server did."""
    return [python, "-m", module, "--model-path", model_dir, "--host", "127.0.0.1", "--port", str(port),
            "--skip-tokenizer-init", "--enable-return-routed-experts", "--attention-backend", "triton",
            "--sampling-backend", "pytorch", "--disable-cuda-graph", "--disable-piecewise-cuda-graph",
            "--mem-fraction-static", str(mem_fraction), "--random-seed", "0", "--log-level", "info"]


class SGLangServer:
    """``with SGLangServer(cmd, port, log) as addr:`` the server subprocess (its own process group),
    ready when ``GET /health`` answers 200 within ``timeout`` s; otherwise, or when it exits first,
    ``RuntimeError`` with its log's tail. Killed (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, cmd: Sequence[str], port: int, log_path: str, *, timeout: float = 300.0,
                 env: Optional[dict] = None) -> None:
        self.cmd, self.port, self.log_path, self.timeout, self.env = list(cmd), port, log_path, timeout, env
        self.proc: Optional[subprocess.Popen] = None
        self.ready_s: Optional[float] = None

    def tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def __enter__(self) -> str:
        t0 = time.time()
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        log.close()
        addr = f"127.0.0.1:{self.port}"
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"SGLang server exited with status {self.proc.returncode} before it was "
                                       f"ready ({time.time() - t0:.0f} s); log tail:\n{self.tail()}")
                if time.time() - t0 > self.timeout:
                    raise RuntimeError(f"SGLang server not ready after {self.timeout:.0f} s; log tail:\n{self.tail()}")
                try:
                    with urllib.request.urlopen(f"http://{addr}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                time.sleep(1.0)
        except BaseException:
            self.stop()
            raise
        self.ready_s = round(time.time() - t0, 1)
        return addr

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# ----------------------------------------------------------------------------------- the rollout
def turns_reward(prompt: str, completion: str, input_tokens: list, output_tokens: list, **data: Any) -> float:
    """1 once the episode reached its ``turns``-th turn (each later turn's prompt holds the
    workflow's amend tokens once more), else 0: ``MultiTurnWorkflow`` retries on 0. Module level:
    AReaL runs rewards in a process pool."""
    amend, seq = list(data["amend"]), list(input_tokens)
    n = len(amend)
    seen = sum(1 for i in range(len(seq) - n + 1) if seq[i:i + n] == amend)
    return 1.0 if 1 + seen >= int(data["turns"]) else 0.0


_CURRENT_INPUT: contextvars.ContextVar = contextvars.ContextVar("r3_stub_input", default=None)


def recording_backend_class() -> type:
    """AReaL's ``SGLangBackend`` that also records each attempt: the request's ``input_ids`` (in the
    request's task) and the response's ``meta_info`` / ``output_ids`` as SGLang returned them."""
    base = import_areal("areal.engine.sglang_remote").SGLangBackend

    class RecordingSGLangBackend(base):
        def __init__(self) -> None:
            super().__init__()
            self.attempts: list[dict] = []

        def build_generation_request(self, req: Any, with_lora: bool, version: int) -> Any:
            http = super().build_generation_request(req, with_lora, version)
            _CURRENT_INPUT.set(list(http.payload["input_ids"]))
            return http

        def parse_generation_response(self, response: dict) -> Any:
            meta = response.get("meta_info", {})
            keep = ("prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "routed_experts", "id")
            self.attempts.append({"input_ids": _CURRENT_INPUT.get(),
                                  "output_ids": [int(x[1]) for x in meta.get("output_token_logprobs") or []],
                                  "meta_info": {k: meta[k] for k in keep if k in meta}})
            return super().parse_generation_response(response)

    return RecordingSGLangBackend


def rollout_objects(hf_cfg: Any, tokenizer: Any, *, n: int, max_new_tokens: int, max_turns: int = 3) -> dict:
    """What the rollout builds before any server exists (``--dry-run`` shows them): AReaL's
    ``InferenceEngineConfig``, the engine class (``SGLangEngineMixin`` + ``RemoteSGLangEngine``),
    the workflow (``WorkflowMixin`` + ``MultiTurnWorkflow``) and the episodes' data."""
    from r3bridge.adapters.areal import SGLangEngineMixin, workflow_class

    cli = import_areal("areal.api.cli_args")
    remote = import_areal("areal.engine.sglang_remote")
    mt = import_areal("areal.workflow.multi_turn")
    config = cli.InferenceEngineConfig(experiment_name="r3bridge", trial_name="sglang", backend="sglang:d1", max_concurrent_rollouts=n,
                                       consumer_batch_size=n, queue_size=4 * n, max_head_offpolicyness=100,
                                       return_routed_experts=True, request_timeout=120, request_retries=2,
                                       setup_timeout=120, pause_grace_period=0.5)
    engine_cls = type("R3BridgeRemoteSGLangEngine", (SGLangEngineMixin, remote.RemoteSGLangEngine), {})
    gconfig = cli.GenerationHyperparameters(n_samples=1, max_new_tokens=max_new_tokens, temperature=1.0,
                                            max_tokens=hf_cfg.max_position_embeddings)
    workflow = workflow_class(mt.MultiTurnWorkflow, hf_cfg)(reward_fn=turns_reward, gconfig=gconfig,
                                                            tokenizer=tokenizer, max_turns=max_turns, turn_discount=0.9)
    g = np.random.default_rng(3)
    data = [{"messages": [{"role": "user", "content": " ".join(f"w{int(w)}" for w in g.integers(0, 100, 6 + 3 * i))}],
             "turns": 1 + i % max_turns, "amend": list(workflow.multi_turn_prompt_ids), "sample": i}
            for i in range(n)]
    return dict(config=config, engine_cls=engine_cls, workflow=workflow, data=data, gconfig=gconfig)


def run_rollout(addr: str, hf_cfg: Any, *, n: int = 8, max_new_tokens: int = 48,
                interrupts: Sequence[int] = (1, 5, 10), timeout: float = 240.0) -> "RecordedRollout":
    """``n`` multi-turn episodes through AReaL's engine client and executor against ``addr``,
    interrupted (AReaL's pause / resume around a weight update) as soon as the server has answered
    each of ``interrupts`` responses in all: the other requests are then mid-decode, on any
    machine, however fast (a timer would race the server's first kernel compilations); the
    trajectories in ``sample`` order, each attempt recorded."""
    objs = rollout_objects(hf_cfg, tiny_tokenizer(), n=n, max_new_tokens=max_new_tokens)
    engine = objs["engine_cls"](objs["config"])
    engine.initialize(addr=addr)
    backend = recording_backend_class()()
    engine._engine.backend = backend        # RemoteSGLangEngine -> RemoteInfEngine's backend
    t0 = time.time()
    try:
        for d in objs["data"]:
            engine.submit(d, workflow=objs["workflow"])
        for at in sorted(interrupts):
            while len(backend.attempts) < at and time.time() - t0 < timeout:   # the episodes' turns
                time.sleep(0.005)            # alone make more responses than any trigger (n + n // 3 * 3)
            engine.pause()                   # as AReaL's trainer around a weight update
            engine.pause_generation()        # SGLang aborts what is in flight (mode "abort")
            time.sleep(0.2)
            engine.continue_generation()
            engine.resume()
        trajs = engine.wait(n, timeout=timeout)
    finally:
        engine.destroy()
    seconds = round(time.time() - t0, 2)
    if len(trajs) != n or any(t is None for t in trajs):
        raise RuntimeError(f"AReaL's executor returned {len(trajs)} trajectories ({sum(t is None for t in trajs)} "
                           f"rejected) for {n} episodes")
    # the executor returns them in completion order: back to the episodes' order by their prompt
    firsts = {tuple(apply_template(objs["workflow"], d)): d["sample"] for d in objs["data"]}
    order = []
    for t in trajs:
        ids = t["input_ids"][0].tolist()
        hit = [s for p, s in firsts.items() if ids[:len(p)] == list(p)]
        if len(hit) != 1:
            raise RuntimeError(f"a trajectory's prompt matches {len(hit)} episodes")
        order.append(hit[0])
    trajs = [t for _, t in sorted(zip(order, trajs), key=lambda x: x[0])]
    info = _model_facts(hf_cfg)
    return RecordedRollout(trajectories=trajs, attempts=list(backend.attempts), seconds=seconds, **info)


def apply_template(workflow: Any, d: dict) -> list[int]:
    hf_utils = import_areal("areal.utils.hf_utils")
    return hf_utils.apply_chat_template(workflow.tokenizer, d["messages"], tokenize=True, add_generation_prompt=True)


def _model_facts(hf_cfg: Any) -> dict:
    from r3bridge.hf import ModelInfo

    m = ModelInfo.from_hf_config(hf_cfg)
    return dict(num_layers=m.num_layers, moe_layer_ids=list(m.moe_layer_ids), num_experts=m.num_experts, topk=m.topk)


def _decode(meta: dict, layers: int, topk: int) -> np.ndarray:
    raw = meta.get("routed_experts")
    if raw is None:
        return np.zeros((0, layers, topk), dtype=np.int32)
    flat = np.frombuffer(base64.b64decode(raw), dtype="<i4")
    # rows from the payload itself, from row 0 (an aborted attempt's count is whatever SGLang
    # routed; the adapter checks it against prompt + completion - 1 and says so when it differs)
    return flat.reshape(-1, layers, topk)


@dataclass
class RecordedRollout:
    """Trajectories from AReaL's rollout and every attempt's SGLang response (picklable: the actor's
    ranks get it). ``tokens``: each trajectory's tokens; :meth:`expected` the routes to replay."""

    trajectories: list
    attempts: list
    num_layers: int
    moe_layer_ids: list
    num_experts: int
    topk: int
    seconds: float = 0.0
    tokens: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = [t["input_ids"][0].tolist() for t in self.trajectories]

    def _own_attempts(self, seq: Sequence[int]) -> list[tuple[dict, list[int]]]:
        """The attempts whose tokens (request + output) lie on this trajectory, in the order sent."""
        seq = list(seq)
        out = []
        for a in self.attempts:
            toks = list(a["input_ids"] or []) + list(a["output_ids"])
            if toks and seq[:len(a["input_ids"])] == list(a["input_ids"]):
                out.append((a, toks))
        return out

    def rows_of(self, i: int) -> tuple[np.ndarray, np.ndarray, dict]:
        """Sample ``i``'s first-seen routes ``[len - 1, L_moe, K]`` rebuilt from its attempts (each
        attempt's rows from row 0 over its own tokens, kept while they agree with the trajectory),
        the covered mask, and counts: attempts, turns, resubmits, rows served from cached prefixes
        and how many of those differ from the first-seen rows, overlapping rows that differ."""
        seq = self.tokens[i]
        n = len(seq) - 1
        rows = np.zeros((n, self.num_layers, self.topk), dtype=np.int32)
        have = np.zeros(n, dtype=bool)
        st = dict(attempts=0, turns=0, resubmits=0, cached_rows=0, cached_rows_differing=0,
                  overlap_rows=0, overlap_rows_differing=0)
        for a, toks in self._own_attempts(seq):
            meta = a["meta_info"]
            st["attempts"] += 1
            if meta.get("finish_reason", {}).get("type") == "abort":
                st["resubmits"] += 1          # the client sends the request again
            r = _decode(meta, self.num_layers, self.topk)
            agree = 0
            while agree < min(len(toks), len(seq)) and toks[agree] == seq[agree]:
                agree += 1
            m = min(len(r), agree, n)
            cached = min(int(meta.get("cached_tokens") or 0), m)
            for j in range(m):
                if have[j]:
                    same = bool((np.sort(rows[j], -1) == np.sort(r[j], -1)).all())
                    st["overlap_rows"] += 1
                    st["overlap_rows_differing"] += not same
                    if j < cached:
                        st["cached_rows"] += 1
                        st["cached_rows_differing"] += not same
                else:
                    rows[j], have[j] = r[j], True
        resubmit_next = False
        for a, _ in self._own_attempts(seq):          # a turn: an attempt that is not a resubmit
            st["turns"] += not resubmit_next
            resubmit_next = a["meta_info"].get("finish_reason", {}).get("type") == "abort"
        return rows[:, self.moe_layer_ids], have, st

    def expected(self) -> Any:
        """The rollout's routes as the actor must replay them (one sequence per trajectory, first-seen)."""
        from r3bridge.batch.schema import ReplayBatch

        built = [self.rows_of(i) for i in range(len(self.tokens))]
        return ReplayBatch.from_ragged([r for r, _, _ in built], num_experts=self.num_experts,
                                       layer_ids=self.moe_layer_ids, valid=[h for _, h, _ in built],
                                       route_kind="rollout")

    def checks(self) -> dict:
        """The adapter's trajectories against :meth:`expected` (multi-turn and resubmit stitching),
        and the counts per rollout."""
        from r3bridge.adapters.areal.codec import ROUTES_KEY

        want = self.expected()
        totals: dict[str, int] = {}
        problems = []
        per_sample = []
        for i, t in enumerate(self.trajectories):
            _, _, st = self.rows_of(i)
            per_sample.append(st)
            for k, v in st.items():
                totals[k] = totals.get(k, 0) + v
            got = t.get(ROUTES_KEY)
            if got is None:
                problems.append(f"sample {i}: no {ROUTES_KEY} in the trajectory")
                continue
            exp = want.select([i])
            n = exp.rows_per_seq[0]
            g = got[0].permute(2, 0, 1)[:n].long()            # [B, L, K, S] -> [S, L, K]
            e = exp.routes.long()
            v = exp.valid
            bad = int((g[v].sort(-1).values != e[v].sort(-1).values).any(-1).any(-1).sum())
            if bad:
                problems.append(f"sample {i}: {bad} of {int(v.sum())} rows differ from the recorded first-seen routes")
        totals["samples"] = len(self.trajectories)
        totals["multi_turn_samples"] = sum(1 for s in per_sample if s["turns"] > 1)
        totals["resubmitted_samples"] = sum(1 for s in per_sample if s["resubmits"] > 0)
        totals["rows"] = int(want.valid.sum())
        ok = (not problems and totals["multi_turn_samples"] > 0 and totals["resubmitted_samples"] > 0
              and totals["cached_rows"] > 0)
        return {"ok": ok, "stitching_problems": problems[:10], **totals, "per_sample": per_sample}

    @classmethod
    def from_payloads(cls, doc: dict, trajectories: Sequence[dict] = ()) -> "RecordedRollout":
        """A recorded run back from :meth:`payloads` (``$OUT/areal_sglang_payloads.json``, the CPU
        fixture): the attempts and tokens, ``trajectories`` if given (else none: :meth:`expected`
        and the counts of :meth:`rows_of` need only the attempts)."""
        return cls(trajectories=list(trajectories), attempts=doc["attempts"], tokens=doc["trajectory_tokens"],
                   num_layers=doc["num_hidden_layers"], moe_layer_ids=doc["moe_layer_ids"],
                   num_experts=doc["num_experts"], topk=doc["topk"])

    def payloads(self) -> dict:
        """What $OUT keeps (the CPU fixture's content): the model's facts, every attempt, the tokens."""
        return {"engine": "sglang", "framework": "areal", "num_hidden_layers": self.num_layers,
                "moe_layer_ids": self.moe_layer_ids, "num_experts": self.num_experts, "topk": self.topk,
                "attempts": self.attempts, "trajectory_tokens": self.tokens}

    def write(self, out_dir: str, hf_cfg: Any = None, name: str = "areal_sglang_payloads.json") -> str:
        os.makedirs(out_dir, exist_ok=True)
        doc = self.payloads()
        if hf_cfg is not None:
            doc["hf_config"] = hf_cfg.to_dict()
        path = os.path.join(out_dir, name)
        with open(path, "w") as f:
            json.dump(doc, f, default=str)
        return path


def server_env(pythonpath: Optional[str]) -> dict:
    """The server's environment: this one with ``PYTHONPATH`` replaced (SGLang's own site: the
    actor's sites carry other openai / transformers versions), when given."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return env


def dry_run(workdir: str, *, n: int, max_new_tokens: int, mem_fraction: float, module: str,
            server_pythonpath: Optional[str]) -> dict:
    """Everything the SGLang run builds before the server starts: the model folder, AReaL's engine
    config, the engine and workflow classes, the episodes (their prompt token ids through the
    workflow's tokenizer and chat template) and the server's command line."""
    cfg = write_model(os.path.join(workdir, "model"))
    objs = rollout_objects(cfg, tiny_tokenizer(), n=n, max_new_tokens=max_new_tokens)
    cli = import_areal("areal.api.cli_args")
    prompts = [apply_template(objs["workflow"], d) for d in objs["data"]]
    return {"server_command": server_command(os.path.join(workdir, "model"), 30000, mem_fraction=mem_fraction,
                                             module=module),
            "server_pythonpath": server_pythonpath,
            "engine_config": cli.conf_as_dict(objs["config"]) if hasattr(cli, "conf_as_dict") else str(objs["config"]),
            "engine_class": [c.__module__ + "." + c.__qualname__ for c in objs["engine_cls"].__mro__[:3]],
            "workflow_class": [c.__module__ + "." + c.__qualname__ for c in type(objs["workflow"]).__mro__[:3]],
            "gconfig": str(objs["gconfig"]),
            "episodes": [{"turns": d["turns"], "prompt_ids": p} for d, p in zip(objs["data"], prompts)],
            "amend_ids": objs["data"][0]["amend"], "model": _model_facts(cfg)}


def serve_and_roll(workdir: str, out_dir: Optional[str], *, n: int, max_new_tokens: int, mem_fraction: float,
                   module: str, server_pythonpath: Optional[str], server_timeout: float,
                   interrupts: Sequence[int]) -> tuple["RecordedRollout", dict]:
    """Model folder, server up, AReaL's rollout, server down; the payloads and the server's log into
    ``out_dir``. Returns the rollout and what to report (start and rollout seconds, the checks)."""
    model_dir = os.path.join(workdir, "model")
    env = server_env(server_pythonpath)
    cfg = write_model(model_dir, server_env=env)
    port = free_port()
    log = os.path.join(out_dir or workdir, "sglang_server.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    server = SGLangServer(server_command(model_dir, port, mem_fraction=mem_fraction, module=module), port, log,
                          timeout=server_timeout, env=env)
    with server as addr:
        rr = run_rollout(addr, cfg, n=n, max_new_tokens=max_new_tokens, interrupts=interrupts)
    info = {"server_ready_s": server.ready_s, "rollout_s": rr.seconds, "server_module": module,
            "attempts": len(rr.attempts), "checks": rr.checks()}
    if out_dir:
        rr.write(out_dir, cfg)
    return rr, info
