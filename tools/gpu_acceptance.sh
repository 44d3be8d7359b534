#!/usr/bin/env bash
# The first thing to run on a GPU machine or inside the image: every user path on CUDA in a few
# minutes — the quick start (fp32), a bf16 packed run (TP=2 under torchrun when 2 GPUs exist),
# the SDPA and Transformer Engine attention backends and a checkpoint moved between their layer
# specs, the eval tool, an HF -> megatron -> HF conversion round trip, a tiny Qwen3-MoE trained
# from its HF directory (TE's grouped experts when TE imports; EP=2 on 2 GPUs) whose checkpoint
# the local spec reads back and whose hf/ transformers reloads, a resume, and a short
# benchmark against TRL. One PASS / FAIL / SKIP line per check, with tokens/s, MFU and peak
# memory from each run's metrics.jsonl, then a summary; exit code 1 if any check failed.
#
#   bash tools/gpu_acceptance.sh                     # all checks (SKIP no CUDA without a GPU)
#   bash tools/gpu_acceptance.sh --cpu               # the same checks on the CPU, tiny settings
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
