"""Which layout for this model on this cluster? Memory per rank and a roofline step time.

    python tools/plan_layout.py --hf-config /models/Meta-Llama-3-8B --gpus 8 --gpu-memory 80GB
    python tools/plan_layout.py --hf-config config.json --gpus 1 --gpu-memory 24GB --seq 2048
    python tools/plan_layout.py --hf-config config.json --gpus 1 --gpu-memory 24GB --lora-rank 16

Reads a Hugging Face config.json (a file or the directory holding it; every family
`tools/convert_checkpoint.py` imports, the mixture-of-experts ones, GPT-OSS and DeepSeek-V3
included), enumerates every valid TP / PP / DP (× EP / ETP for an MoE model) × micro-batch ×
recomputation × reference strategy for a KTO run (a LoRA run with `--lora-rank`: adapters on
`--lora-targets`, reference adapters-off or precomputed; an MoE model's adapters on its
attention, its experts frozen and split over EP), and prints the fastest few that fit (or, if
none does, the smallest and by how much it misses). How memory and time are estimated, and every
assumption: `megatron_kto/planning/` (`model_state.py`, `memory.py`, `activations.py`,
`layout.py`). Exit code 0 when something fits, 1 when nothing does, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.hf_config import ConversionError
from megatron_kto.conversion.hf_dir import model_architecture, read_json
from megatron_kto.peft.targets import check_moe_targets, resolve_targets
from megatron_kto.planning.layout import GPU_TYPES, Cluster, candidates, format_candidates
from megatron_kto.planning.model_state import LoRAShape

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """'80GB' (10⁹), '80GiB' (2³⁰), '24' (GB) -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"--gpu-memory: cannot read {text!r} (e.g. 80GB or 80GiB)")
    scale = _UNITS[unit] if unit else 1e9
    return int(float(match.group(1)) * scale)


def read_model(path: Path) -> GPTArchitecture:
    """The architecture a run on this Hugging Face config builds (its padded vocabulary too).

    Raises:
        ConversionError: no readable config.json or an unsupported model, naming the file.
    """
    return model_architecture(read_json(path, "--hf-config"), str(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-config", required=True, help="config.json or its directory")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu-memory", required=True, help="per GPU, e.g. 80GB or 80GiB")
    parser.add_argument("--gpu-type", default="H100", choices=sorted(GPU_TYPES))
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (default 4096)")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "16", "32"])
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--lora-rank", type=int, default=None, help="plan a LoRA run of this rank")
    parser.add_argument(
        "--lora-targets",
        default=None,
        help="LoRA target modules, comma-separated (NeMo or Hugging Face names; default all, "
        "an MoE model's attention)",
    )
    args = parser.parse_args(argv)
    path = Path(args.hf_config)
    path = path / "config.json" if path.is_dir() else path
    try:
        memory = parse_bytes(args.gpu_memory)
        if not path.is_file():
            raise ValueError(f"--hf-config: {path} does not exist")
        arch = read_model(path)
        if args.gpus < 1 or args.global_batch < 1:
            raise ValueError("--gpus and --global-batch must be >= 1")
        lora = None
        if args.lora_rank is not None:
            if args.lora_rank < 1:
                raise ValueError(f"--lora-rank: must be >= 1, got {args.lora_rank}")
            names = args.lora_targets or ("attention" if arch.num_moe_experts else "all")
            targets = tuple(t.strip() for t in names.split(",") if t.strip())
            try:
                resolve_targets(list(targets), arch)
                check_moe_targets(list(targets), arch)
            except ValueError as e:
                raise ValueError(f"--lora-targets: {e}") from e
            lora = LoRAShape(args.lora_rank, targets)
    except (ValueError, ConversionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seq = args.seq or min(4096, arch.encoder_seq_length)
    cluster = Cluster(args.gpus, memory, args.gpu_type, min(args.gpus_per_node, args.gpus))
    found = candidates(arch, cluster, seq, args.global_batch, args.precision, lora)
    tuning = f"LoRA rank {lora.rank} on {','.join(lora.targets)}" if lora else "full fine-tuning"
    experts = ""
    if arch.num_moe_experts:
        moe_layers = sum(arch.is_moe_layer(i) for i in range(arch.num_layers))
        experts = (
            f", {arch.num_moe_experts} experts of {arch.moe_ffn_hidden_size or arch.ffn_hidden_size}"
            f" (top-{arch.moe_router_topk}) in {moe_layers} layers"
        )
    print(
        f"model: {arch.num_layers} layers, hidden {arch.hidden_size}, {arch.num_attention_heads} "
        f"heads / {arch.num_query_groups} groups, vocabulary {arch.vocab_size}{experts}; KTO, "
        f"{tuning}, {seq} tokens per row, global batch {args.global_batch}, {args.precision}"
    )
    print("\n".join(format_candidates(found, cluster, args.top, lora)))
    return 0 if any(c.fits for c in found) else 1


if __name__ == "__main__":
    sys.exit(main())
