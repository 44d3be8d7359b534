"""A tiny Hugging Face chat model made here, as a user's real model would arrive.

`make_hf_chat_model(directory)` writes a random-init `transformers` Llama with grouped-query
attention (6 query heads, 3 key/value heads — the 3:1 ratio of SmolLM-style models) and a
ChatML-style byte-level BPE tokenizer trained with the `tokenizers` library on the bundled
example's text (its `tokenizer_config.json` names a `bos_token` without adding it, and carries a
chat template), saved with `save_pretrained` next to each other: a directory
`tools/convert_checkpoint.py import` takes as it takes a downloaded model.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_TRAIN = REPO / "examples" / "data" / "tiny_kto" / "train.jsonl"

HEADS, KV_HEADS, LAYERS, HIDDEN = 6, 3, 4, 48
MAX_POSITIONS = 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    rows = [json.loads(line) for line in EXAMPLE_TRAIN.read_text().splitlines()]
    return [f"{r['prompt']} {r['completion']}" for r in rows]


def make_tokenizer(directory: Path) -> int:
    """Train the byte-level BPE tokenizer into `directory`; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
        "model_max_length": MAX_POSITIONS,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok.get_vocab_size()


def make_hf_chat_model(
    directory: Path, seed: int = 0, kv_heads: int = KV_HEADS, tie: bool = True
) -> Path:
    """Write the model (config.json + safetensors) and its tokenizer into `directory`
    (`kv_heads` key/value heads of the 6 query heads; `tie`: tied input/output embeddings)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = make_tokenizer(directory)
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.1,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def write_kto_rows(path: Path, start: int, count: int) -> Path:
    """`count` rows of the bundled example's training data from `start` (a user's data file)."""
    lines = EXAMPLE_TRAIN.read_text().splitlines()[start : start + count]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_qwen3_moe_config(vocab: int, **extra):
    """A 2-layer Qwen3-MoE config (hidden 64, 4 experts of 48, top-2, GQA 4/2, head_dim 16)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab,
        max_position_embeddings=128,
        initializer_range=0.1,
        **extra,
    )


def make_hf_qwen3_moe(directory: Path, router_aux_loss_coef: float) -> Path:
    """Write a random `tiny_qwen3_moe_config` model (untied embeddings) with decisive routers —
    router weights ~N(0, 1), so top-k choices are far from ties and round-off never flips a
    routing choice — and its tokenizer into `directory`."""
    import torch
    from transformers import AutoModelForCausalLM

    vocab = make_tokenizer(directory)
    torch.manual_seed(0)
    config = tiny_qwen3_moe_config(
        vocab,
        router_aux_loss_coef=router_aux_loss_coef,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 1.0)
    model.save_pretrained(directory)
    return directory


def save_sigmoid_routed(
    model, directory: Path, router_std: float | None = 0.3, bias_std: float = 0.3
) -> None:
    """Save a sigmoid-routed `transformers` MoE (GLM-4.5, DeepSeek-V3) with its routers drawn far
    from ties (N(0, `router_std`); None keeps the model's init) and non-zero random expert-score
    correction biases (N(0, `bias_std`))."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if router_std is not None and name.endswith("mlp.gate.weight"):
                p.normal_(0.0, router_std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(bias_std * torch.randn_like(b))
    model.save_pretrained(directory)


#: The tiny GLM-4.5 (`glm4_moe`) of the TRL-parity and new-user tests: a dense first layer, then
#: 4 sigmoid-routed experts (top-2) with an ungated shared expert; q/k/v biases, partial rotary.
TINY_GLM4_MOE = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=48,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    attention_bias=True,
    max_position_embeddings=128,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
)

#: The tiny DeepSeek-V3 of the TRL-parity and new-user tests (`test_deepseek_v3.py` starts its two
#: models from it too): the same MoE (one group, routed scaling 1.5) under multi-latent attention
#: with a query bottleneck, v head dim 12 != qk 16 + 8 rotated, YaRN with mscales.
TINY_DEEPSEEK_V3 = dict(
    {k: v for k, v in TINY_GLM4_MOE.items() if k not in ("head_dim", "attention_bias")},
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.5,
    num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    num_nextn_predict_layers=0,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 0.9,
        "mscale_all_dim": 0.7,
    },
)


def make_hf_sigmoid_routed(
    directory: Path,
    model_type: str,
    router_std: float | None = 0.3,
    bias_std: float = 0.3,
    **changes,
) -> Path:
    """Write a random tiny `glm4_moe` or `deepseek_v3` (`tiny_sigmoid_routed_config`) and its
    tokenizer into `directory`, saved by `save_sigmoid_routed`."""
    import torch
    from transformers import AutoModelForCausalLM

    vocab = make_tokenizer(directory)
    torch.manual_seed(0)
    config = tiny_sigmoid_routed_config(model_type, vocab, **changes)
    save_sigmoid_routed(AutoModelForCausalLM.from_config(config), directory, router_std, bias_std)
    return directory


def tiny_sigmoid_routed_config(model_type: str, vocab: int, **changes):
    """The `transformers` config of a tiny `glm4_moe` or `deepseek_v3`: `TINY_GLM4_MOE` /
    `TINY_DEEPSEEK_V3` with `vocab` tokens and `changes` over any of it."""
    from transformers import AutoConfig

    tiny = {"glm4_moe": TINY_GLM4_MOE, "deepseek_v3": TINY_DEEPSEEK_V3}[model_type]
    return AutoConfig.for_model(model_type, **{**tiny, "vocab_size": vocab, **changes})


def hf_tensors(model_dir: Path) -> dict:
    """Every tensor of a Hugging Face directory's safetensors, by name."""
    from megatron_kto.conversion.safetensors_io import HFWeights

    weights = HFWeights(model_dir)
    return {name: weights.get(name) for name in weights.names()}


def make_peft_adapter(directory: Path, num_layers: int, **lora) -> Path:
    """A LoRA adapter directory written by `peft` itself (`save_pretrained`: adapter_config.json
    + adapter_model.safetensors) for a tiny random Llama of `num_layers` layers.

    Args:
        lora: `peft.LoraConfig` arguments (r, lora_alpha, target_modules, layers_to_transform...).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=32,
    )
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(task_type="CAUSAL_LM", **lora))
    model.save_pretrained(str(directory))
    return directory


def hf_row_logp_sums(model, tokens, lengths):
    """Each row's Σ log π(token_{t+1}) over its own length (`lengths[i]` tokens of row i of
    `tokens`) under a `transformers` model, one row at a time, log-softmax in fp64."""
    import torch

    out = []
    with torch.no_grad():
        for i, n in enumerate(lengths):
            logits = model(tokens[i : i + 1, :n]).logits[0, :-1].double()
            out.append(logits.log_softmax(-1).gather(-1, tokens[i, 1:n, None]).sum())
    return torch.stack(out)
