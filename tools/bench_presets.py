"""The `--preset`s of `tools/bench_kto.py` (also used by `profile_kto.py` and
`bench_lora_memory.py`): the overrides every bench run starts from, the long-tailed data set and
the model shapes measured on it.

Standard library only, like `bench_kto.py`'s module level (see its note on max-RSS).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: Overrides the bench puts before the user's: outputs that cost time but are not measured.
BENCH_DEFAULTS = [
    "exp_manager.create_checkpoint_callback=false",
    "exp_manager.create_tensorboard_logger=false",
    "exp_manager.resume_if_exists=false",
    "trainer.kto.limit_val_batches=0",
    "trainer.kto.save_interval=0",
    "model.data.shuffle=false",
]

#: The long-tailed benchmark set: `tools/make_bench_data.py` arguments (its defaults, named so
#: the file name changes if they do).
LONGTAIL_DATA = {"rows": 2048, "seed": 0, "max_length": 1024}
#: `--preset longtail`: the compute-dominated shape on that set.
LONGTAIL_MODEL = [
    "model.num_layers=8",
    "model.hidden_size=512",
    "model.ffn_hidden_size=1536",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    f"model.encoder_seq_length={LONGTAIL_DATA['max_length']}",
    f"model.data.max_length={LONGTAIL_DATA['max_length']}",
    "model.data.data_prefix.validation=[]",
]
#: `--preset longtail_moe`: the same shape with a mixture-of-experts MLP in every layer, 8
#: experts, 2 routed per token, each expert half the dense width (so a token's MLP FLOPs equal
#: the dense model's, which is what the MFU count assumes), and the router load-balancing loss
#: (coefficient 0.01) on both sides. Add model.expert_model_parallel_size=2 under torchrun for EP
#: (and model.expert_tensor_parallel_size for an expert TP apart from TP).
LONGTAIL_MOE = [
    "model.num_moe_experts=8",
    "model.moe_router_topk=2",
    "model.moe_ffn_hidden_size=768",
    "model.moe_aux_loss_coeff=0.01",
]


#: `--preset longtail_hybrid`: a Qwen3.5 text model (`qwen3_5_text`) built from a `transformers`
#: config — 4 layers: three gated DeltaNet layers (2 key / 4 value heads of 64), then gated full
#: attention (4 query / 2 KV heads of 64); hidden 256, SwiGLU 768, the bundled tokenizer's 384
#: tokens — that both sides load from one Hugging Face directory (ours directly, TRL with
#: `AutoModelForCausalLM`, running transformers' torch fallback of the DeltaNet kernels on CPU).
HYBRID_CONFIG = {
    "model_type": "qwen3_5_text", "vocab_size": 384, "hidden_size": 256,
    "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "max_position_embeddings": LONGTAIL_DATA["max_length"], "tie_word_embeddings": False,
}  # fmt: skip


def hybrid_model() -> Path:
    """The `longtail_hybrid` model's Hugging Face directory, written on first use (seeded) in a
    subprocess, like the data (see the note on max-RSS above)."""
    path = Path(tempfile.gettempdir()) / "megatron_kto_bench" / "qwen3_5_hybrid_seed0"
    if not (path / "config.json").exists():
        subprocess.run(
            [sys.executable, __file__, "--make-hybrid", str(path)],
            check=True, cwd=REPO, stdout=sys.stderr,
        )  # fmt: skip
    return path


def _make_hybrid(path: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(HYBRID_CONFIG)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    model.save_pretrained(path)


def longtail_data() -> Path:
    """The long-tailed set, generated on first use (in a subprocess, so that this process does
    not import the tokenizer: see the note on max-RSS above)."""
    d = LONGTAIL_DATA
    path = (
        Path(tempfile.gettempdir())
        / "megatron_kto_bench"
        / (f"kto_longtail_rows{d['rows']}_seed{d['seed']}_max{d['max_length']}.jsonl")
    )
    if not path.exists():
        cmd = [sys.executable, str(Path(__file__).with_name("make_bench_data.py")), "--out",
               str(path), "--rows", str(d["rows"]), "--seed", str(d["seed"]),
               "--max-length", str(d["max_length"])]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=REPO, stdout=sys.stderr)
    return path


def longtail_pairs() -> Path:
    """The long-tailed set as DPO pairs (for `tools/bench_kto.py --objective`): each desirable
    row's prompt and completion as chosen, the next undesirable row's completion as rejected,
    so the chosen and rejected lengths keep the set's long tail. Written once beside it."""
    source = longtail_data()
    path = source.with_name(source.stem.replace("kto_", "dpo_") + ".jsonl")
    if not path.exists():
        rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
        rejected = iter([r["completion"] for r in rows if not r["label"]])
        pairs = []
        for row in (r for r in rows if r["label"]):
            other = next(rejected, None)
            if other is None:
                break
            pairs.append({"prompt": row["prompt"], "chosen": row["completion"], "rejected": other})
        path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return path


#: `--objective` runs (DPO-family loss types): the KTO preset's rows per step and per
#: micro-batch as pairs (16 rows = 8 pairs a step, 4 rows = 2 pairs a micro-batch).
DPO_BATCH = ["model.global_batch_size=8", "model.micro_batch_size=2"]


def bench_defaults(algorithm: str) -> list[str]:
    """`BENCH_DEFAULTS` for `algorithm`'s loop keys (`trainer.kto` or `trainer.dpo`)."""
    return [d.replace("trainer.kto.", f"trainer.{algorithm}.") for d in BENCH_DEFAULTS]


def preset_overrides(preset: str, algorithm: str = "kto") -> list[str]:
    """Hydra overrides of a `--preset` (before the user's own); `algorithm` "dpo" gives the
    bundled DPO example's settings and the set's pairs (`longtail_pairs`)."""
    if preset == "example":
        return []
    if algorithm == "dpo":
        return [
            "example=tiny_dpo",
            *LONGTAIL_MODEL,
            *(LONGTAIL_MOE if preset == "longtail_moe" else []),
            *DPO_BATCH,
            f"model.data.data_prefix.train=[{longtail_pairs()}]",
        ]
    if preset == "longtail_hybrid":  # the shape is the Hugging Face directory's
        return [
            "example=tiny_kto",
            f"pretrained_checkpoint.restore_from_path={hybrid_model()}",
            # The tiny preset's shape, restated as the directory's (a contradiction is an error).
            f"model.num_layers={HYBRID_CONFIG['num_hidden_layers']}",
            f"model.hidden_size={HYBRID_CONFIG['hidden_size']}",
            f"model.ffn_hidden_size={HYBRID_CONFIG['intermediate_size']}",
            f"model.encoder_seq_length={HYBRID_CONFIG['max_position_embeddings']}",
            f"model.data.max_length={LONGTAIL_DATA['max_length']}",
            "model.data.data_prefix.validation=[]",
            f"model.data.data_prefix.train=[{longtail_data()}]",
        ]
    # The bundled example's settings (fp32, tokenizer, batch sizes, lr) under the larger shape:
    # a run that names its own data no longer gets them implicitly (megatron_kto/entry.py).
    return [
        "example=tiny_kto",
        *LONGTAIL_MODEL,
        *(LONGTAIL_MOE if preset == "longtail_moe" else []),
        f"model.data.data_prefix.train=[{longtail_data()}]",
    ]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make-hybrid"] and len(sys.argv) == 3:
        _make_hybrid(Path(sys.argv[2]))
    else:
        sys.exit("usage: bench_presets.py --make-hybrid DIR")
