#!/usr/bin/env bash
# The first thing to run on a GPU machine or inside the image: the user paths on CUDA in a few
# minutes — the quick start (fp32), a bf16 packed run (TP=2 under torchrun when 2 GPUs exist),
# the SDPA and Transformer Engine attention backends and a checkpoint moved between their layer
# specs, an HF -> megatron -> HF conversion round trip, a tiny Qwen3-MoE trained from its HF
# directory (TE's grouped experts when TE imports; EP=2 on 2 GPUs) whose checkpoint the local
# spec reads back and whose hf/ transformers reloads, the eval tool, a resume, LoRA (TE spec
# when TE imports, else the local spec; step 1 must equal the adapters-off reference), the
# distributed optimizer with overlapped grad reduce-scatter and param all-gather (DP=2 on 2
# GPUs, else DP=1) and a resume of it, and a short benchmark against TRL. With 2 GPUs also: the
# MoE model at PP=2 with the router aux loss, CP=2 (TE spec when TE imports), PP=2, and a
# `restart` (torchrun --max-restarts 1, rank 1 killed after the first checkpoint: NCCL groups
# formed again, resumed, finished); on one GPU these four print SKIP with the reason. One PASS / FAIL / SKIP line per check, with its
# wall time and budget and tokens/s, MFU and peak memory from each run's metrics.jsonl, then a
# summary with the total time; exit code 1 if any check failed.
#
# Time budgets (tools/acceptance_checks.py BUDGETS, GPU seconds at the default 20 steps, from
# figures measured on one H200 plus ~50%; a check that uses up its budget is stopped and FAILs):
# quickstart 45, bf16_packing 40, attention_sdpa 40, attention_te 45, te_local_checkpoint 80,
# conversion 90, moe 70, eval 50, resume 35, lora 40, distributed_optimizer 70, bench_trl 75 —
# 555 s on one GPU without TE (the lent machine's case: one call of its 10-minute limit; a lent
# session has 15 minutes, machine start-up included); TE's two checks add 125 s; with 2 GPUs
# moe_pp 60, context_parallel 50, pipeline 50 and restart 80 add 240 s. --budget-scale F stretches them
# (0: none; --cpu and a non-default
# --steps run without budgets). On the CPU (--cpu, 2 shared cores, 2026-11-27) all checks took
# 173 s: the longest were distributed_optimizer (30 s, 2 gloo ranks) and conversion (28 s).
#
#   bash tools/gpu_acceptance.sh                     # all checks (SKIP no CUDA without a GPU)
#   bash tools/gpu_acceptance.sh --cpu               # the same checks on the CPU, tiny settings
#                                                    # (the 2-rank ones over gloo, torchrun)
#   bash tools/gpu_acceptance.sh --checks quickstart,resume --work /tmp/acc --steps 50
#
# The checks themselves are tools/acceptance_checks.py (python tools/acceptance_checks.py -h).
#
# Setup. In the image (Dockerfile) nothing. From a fresh checkout nothing for megatron_kto itself:
# the script puts the checkout first on PYTHONPATH (no install, no network). torch,
# megatron-core 0.16.1, hydra-core/omegaconf, sentencepiece, tokenizers, safetensors and psutil
# must be importable; transformers (conversion check) and trl (benchmark check) are optional.
# A machine without a package index (e.g. a lent Python 3.12 + torch GPU box that has
# transformers, sentencepiece, tokenizers, safetensors, psutil): bring the missing wheels —
# megatron-core==0.16.1, hydra-core==1.3.8, omegaconf==2.3.1, antlr4-python3-runtime==4.9.3
# (PyPI has only its sdist: `pip wheel --no-deps antlr4-python3-runtime==4.9.3 -w .whl`), and
# trl + datasets (+ their missing needs) for the benchmark check — then, there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site; bash tools/gpu_acceptance.sh --work $OUT/acc
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo" || exit 2
python="${PYTHON:-python3}"
command -v "$python" >/dev/null || python=python

# This checkout's megatron_kto first, whatever else is installed: the checks are of this code.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
missing=$("$python" - <<'EOF'
import importlib.util
need = ["torch", "megatron.core", "hydra", "omegaconf", "sentencepiece", "tokenizers",
        "safetensors", "psutil"]
print(" ".join(n for n in need if importlib.util.find_spec(n.split(".")[0]) is None
               or (n == "megatron.core" and importlib.util.find_spec(n) is None)))
EOF
)
if [ -n "$missing" ]; then
    echo "FAIL setup: cannot import $missing (see the setup notes in $0)"
    echo "summary: 0 PASS, 1 FAIL, 0 SKIP"
    exit 1
fi

exec "$python" tools/acceptance_checks.py "$@"
