#!/usr/bin/env bash
# verl 0.9.1's whole job on one GPU (issue 22): `python -m r3bridge.adapters.verl.main_ppo` with Ray,
# verl's agent loop, the HF transformers rollout backend (testlab/verl_hf_rollout.py), reward,
# compute_log_prob, reference, GRPO update, 2 steps, for replay_mode R3, R2 and off, every router
# call checked per (sample, token, layer) (testlab/verl_e2e.py: check_run).
#
#   bundle.sh prepare .dev/b base te ray verl   here: the wheels (TE, megatron-core 0.16.1, ray, verl's
#                                 stack) in 52 MiB parts .dev/b/q0..qN (scripts/gpu/bundle.sh); add the
#                                 set `vllm` (vLLM 0.24.0), `vllm026` (0.26.0) or `sglang sglang_verl`
#                                 for those rollouts (docs/gpu.md, "verl on vLLM 0.26.0")
#   bundle.sh stash .dev/b/qI     on the device, one call per part but the last (carry .dev/b/qI)
#   bundle.sh install .dev/b/qN   on the device (carry .dev/b/qN): join, install, then run at once:
#   verl_e2e.sh run MODE [last]   on the device: the job for MODE (R3 | R2 | off); `last` switches
#                                 (R3E2E_CHECK_ONLY=1: check the records a finished job left, no rerun);
#                                 first-seen stitching off (the control); writes $OUT/verl_e2e_TAG.json
#                                 and .log, TAG = MODE_VARIANT, or vllm_MODE_VARIANT_pcN for vLLM (the job's
#                                 own files stay under $R3E2E_WORK, /tmp/r3e2e)
#
# Rollout backend: R3E2E_ROLLOUT=hf (default: testlab/verl_hf_rollout.py), vllm or sglang (verl's own
# vLLM / SGLang server, agent loop and weight sync; needs the bundle's vllm / sglang set in
# /tmp/site-vllm / /tmp/site-sglang, which testlab/verl_e2e.py:rollout_env puts first on PYTHONPATH);
# R3E2E_VLLM_RELEASE=0.24.0 (default, set `vllm`, /tmp/site-vllm, TAG vllm_...) or 0.26.0 (set `vllm026`,
# /tmp/site-vllm026, TAG vllm026_..., heads of 64: 0.26.0's first forward never returns with the model's
# heads of 8; testlab/verl_e2e.py:VLLM_RELEASES); before the job starts, the vLLM the job's processes
# would import is compared with the release asked for (rc 3 when they differ, nothing run);
# R3E2E_DRY_RUN=1: write the job, print the command, environment and that check, run nothing;
# R3E2E_STACKS_AFTER=S: every Python process of the job writes its threads' stacks every S s and runs on
# (testlab/stacks); a job that fails or times out returns them as $OUT/verl_e2e_TAG_stacks.txt (a hung
# job then shows where each process stood);
# R3E2E_PREFIX_CACHE=0|1 (vLLM prefix caching / SGLang radix cache, default 1); R3E2E_VLLM_GPU_MEM /
# R3E2E_SGLANG_GPU_MEM (the engine's share of the GPU, default 0.3, beside the trainer). SGLang: verl's
# own rollout name `sglang`, its routes read by r3bridge (adapters/verl/sglang_routes.py: verl 0.9.1's
# own reading fails on SGLang 0.5.12), triton attention and pytorch sampling through
# engine_kwargs.sglang, heads of 64 (R3E2E_HEAD_DIM, as the direct SGLang run); TAG sglang_MODE_VARIANT_rcN.
#
# Routes by reference (docs/use-with-verl.md, "Routes by reference"): R3E2E_ROUTES=handles appends
# r3bridge.route_transport=handles with the route files under the job's folder (route-store/), the
# tag gets "_handles" and the summary says how many route files the job left (0: each step released).
#
#   verl_e2e.sh run R3        then   R3E2E_ROUTES=handles verl_e2e.sh run R3     (same for R2): the
#   same job inline and by reference, one call each; compare their summaries' metrics
#
# Several GPUs (testlab/verl_e2e_parallel.py): R3E2E_GPUS=N and the trainer's layout R3E2E_TP, R3E2E_EP,
# R3E2E_ETP, R3E2E_PP, R3E2E_VPP, R3E2E_SP (1/0); the files get the layout's name (e.g.
# verl_e2e_R3_first_tp2_sp.json); CUDA_VISIBLE_DEVICES picks the GPUs (jobs can run side by side).
#
# The device keeps ~/stash and what was installed only while the machine stays warm (30 s idle):
# issue the stash calls, the install and the runs back to back (field notes 12).
#
# What differs from the CPU run (testlab/verl_e2e_worker.py skips every CPU shim when CUDA is
# available): NCCL instead of gloo (no VERL_PLATFORM override), real GPUs in Ray, mbridge's own TE
# layer spec and weights. mbridge 0.15.1 cannot build dense-first Qwen3-MoE layers
# (mbridge/models/qwen2moe.py:104), so the GPU model is all-MoE (R3E2E_DENSE=none) and its HF
# weights are saved for mbridge to load (R3E2E_SAVE_WEIGHTS=1). Weight sync trainer -> HF engine is
# still the documented lag of testlab/verl_hf_rollout.py (not loaded); trainer -> vLLM is verl's own
# (the engine starts with dummy weights and serves only what the trainer synced).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
case "${1:-}" in
run)
  mode=$2; variant=${3:-first}
  out=${OUT:-$repo/gpu_verl_e2e_out}; mkdir -p "$out"
  export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 R3E2E_DENSE=${R3E2E_DENSE:-none} R3E2E_SAVE_WEIGHTS=${R3E2E_SAVE_WEIGHTS:-1}
  if [ "${R3E2E_ROLLOUT:-hf}" = sglang ]; then
    # the job's files (config, tokenizer) written with the job's own stack: transformers 5.9.0 and
    # tokenizers 0.22.2 of the sglang_verl / sglang sets, not the image's 5.17.0 / 0.23.2
    export R3E2E_HEAD_DIM=${R3E2E_HEAD_DIM:-64} PYTHONPATH=/tmp/site-sglang_verl:/tmp/site-sglang${PYTHONPATH:+:$PYTHONPATH}
  fi
  cd "$repo"
  python - "$mode" "$variant" "$out" <<'PY'
import json, os, subprocess, sys, time
from testlab import verl_e2e as E
from testlab.verl_e2e_parallel import Parallel
mode, variant, out = sys.argv[1], sys.argv[2], sys.argv[3]
layout = Parallel.from_env().label      # R3E2E_GPUS / _TP / _EP / _PP / _SP ...: "tp1" on one GPU
handles = os.environ.get("R3E2E_ROUTES", "inline") == "handles"
tag = E.run_tag(mode, variant) + ("" if layout == "tp1" else f"_{layout}") + ("_handles" if handles else "")
root = os.path.join(os.environ.get("R3E2E_WORK", "/tmp/r3e2e"), f"verl_e2e_{tag}")
if os.environ.get("R3E2E_CHECK_ONLY") != "1":   # a rerun on a warm machine: never merge an earlier job's records
    import shutil
    shutil.rmtree(root, ignore_errors=True)
paths = E.write_job(root, first_seen=variant != "last")
env = E.job_env(paths, gpu=True)
store = os.path.join(root, "route-store")
command = E.job_command(paths, mode)
if handles:     # routes by reference: route files under the job's folder, released after each step
    command += ["r3bridge.route_transport=handles", f"r3bridge.route_store={store}"]
release = E.vllm_release().version if E.rollout_backend() == "vllm" else None
# the vLLM release asked for (R3E2E_VLLM_RELEASE) must be the one the job's processes import: told
# in a second, not after the job's minutes on the wrong engine
problem = None if os.environ.get("R3E2E_CHECK_ONLY") == "1" else E.installed_vllm_problem(env)
if problem or os.environ.get("R3E2E_DRY_RUN") == "1":   # dry run: the job as it would start, not started
    with open(os.path.join(paths["model"], "config.json")) as f:
        head_dim = json.load(f)["head_dim"]
    print(json.dumps({"tag": tag, "rc": 3 if problem else 0, "error": problem, "vllm_release": release,
                      "head_dim": head_dim, "pythonpath": env["PYTHONPATH"].split(os.pathsep),
                      "command": command[1:]}))
    sys.exit(3 if problem else 0)
t0 = time.monotonic()
if os.environ.get("R3E2E_CHECK_ONLY") == "1":    # re-check a finished job's records (the job is not rerun)
    rc = 0
else:
    with open(os.path.join(root, "job.log"), "w") as log:
        try:  # a hung job still leaves its log in $OUT
            rc = subprocess.run(command, env=env, cwd=root, stdout=log,
                                stderr=subprocess.STDOUT,
                                timeout=float(os.environ.get("R3E2E_TIMEOUT", "480"))).returncode
        except subprocess.TimeoutExpired:
            rc = 124
res = E.read_run(paths, rc)
with open(os.path.join(root, "job.log")) as src, open(os.path.join(out, f"verl_e2e_{tag}.log"), "w") as dst:
    text = src.read()
    dst.write(text[-400000:])
if rc:
    print("\n".join(text.splitlines()[-80:]))
dumps = E.stack_dumps(os.path.join(root, "stacks"))     # R3E2E_STACKS_AFTER: where each process stood
if dumps and rc:    # a failed or hung job: each process's latest dumps (the last 200 kB of its file)
    with open(os.path.join(out, f"verl_e2e_{tag}_stacks.txt"), "w") as f:
        f.writelines(f"==== {name}\n{body[-200000:]}\n" for name, body in dumps.items())
    print(f"stacks of {len(dumps)} processes in verl_e2e_{tag}_stacks.txt")
checks = E.check_run(res, mode, first_seen=variant != "last") if rc == 0 else []
summary = {"mode": mode, "variant": variant, "rollout": E.rollout_backend(), "vllm_release": release, "tag": tag,
           "layout": layout,
           "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "rc": rc, "wall_s": round(time.monotonic() - t0, 1),
           "server_calls": len(res.calls), "router_calls": len(res.dispatch),
           "steps": [c.__dict__ for c in checks], "metrics": E.r3bridge_metrics(res),
           "route_transport": "handles" if handles else "inline", "stack_dumps": len(dumps),
           "route_files_left": sum(len(f) for _, _, f in os.walk(store)) if handles else None}
json.dump(summary, open(os.path.join(out, f"verl_e2e_{tag}.json"), "w"), indent=1, default=str)
print(json.dumps({k: summary[k] for k in ("tag", "rc", "wall_s", "server_calls", "router_calls", "route_files_left")}))
for c in checks:
    agree, rows = c.native_vs_rollout
    print(f"step {c.step}: compared {c.compared}, errors {len(c.errors)}, ref native {c.ref_native}, "
          f"re-prefill disagreeing {c.reprefill}, native vs rollout {agree}/{rows}"
          + (f" = {agree / rows:.3f}" if rows else ""))
control_ok = True
if variant == "last" and rc == 0:
    # the control: verl's own last-call routes must FAIL the first-seen check (the re-prefilled rows)
    wrong = [e for c in E.check_run(res, mode, first_seen=True) for e in c.errors]
    summary["control_first_seen_errors"] = len(wrong)
    json.dump(summary, open(os.path.join(out, f"verl_e2e_{tag}.json"), "w"), indent=1, default=str)
    print(f"control: the last call's routes fail the first-seen check on {len(wrong)} router rows")
    control_ok = bool(wrong)
sys.exit(rc or int(any(c.errors for c in checks)) or int(not control_ok) or int(bool(summary["route_files_left"])))
PY
  ;;
*) sed -n 2,56p "$0"; exit 2 ;;
esac
