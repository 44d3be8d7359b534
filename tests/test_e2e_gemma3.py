"""A new user's walk with a Gemma 3 model: Hugging Face directory in, KTO training with the README
command, `hf/` out, `transformers` generates from it.

A tiny random `transformers` Gemma3ForCausalLM (the bundled tokenizer's vocabulary; sliding window
8 in three of four layers, rows up to 64 tokens) is saved with `save_pretrained`;
`examples/train_gpt_kto.py` trains one step straight from that directory on 2 ranks at TP=2 with
sequence parallelism (`pretrained_checkpoint.restore_from_path`, `exp_manager.save_hf=true`,
packed micro-batches as the defaults have them; `hf/` gathered over TP). The first step's `logps/chosen` / `logps/rejected` (computed before the
update) must equal the same numbers from the `transformers` model on the same rows, and the run's
`hf/` must load in `transformers` as a Gemma 3 whose every tensor moved and which generates.

A second run trains LoRA adapters on every projection (2 steps, lr 1e-2) from the same directory:
its `hf/` adapter loads with `peft` onto the original model under Hugging Face's target names
(q/k/v/o_proj, gate/up/down_proj), moves the logits away from the base, and gives the logits of
the run's merged `hf_merged/` model.
"""

from __future__ import annotations

import json

import pytest
import torch
from e2e_cli import KTO_SCRIPT, QUIET, TOKENIZER, TRAIN_DATA, read_metrics, run_script

pytestmark = pytest.mark.e2e

GLOBAL_BATCH, MAX_LENGTH = 8, 64
RTOL = 1e-5


def _hf_model(vocab: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=vocab,
        max_position_embeddings=128,
        sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        query_pre_attn_scalar=32,
        initializer_range=0.1,  # far from uniform next-token distributions
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # (1 + w) norms away from 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_kto.data.tokenizers import load_tokenizer

    root = tmp_path_factory.mktemp("gemma3")
    tok = load_tokenizer("sentencepiece", str(TOKENIZER))
    model = _hf_model(tok.vocab_size)
    model.save_pretrained(root / "hf")
    common = [
        *QUIET,
        f"pretrained_checkpoint.restore_from_path={root / 'hf'}",
        f"model.data.data_prefix.train=[{TRAIN_DATA}]",
        "model.tokenizer.library=sentencepiece",
        f"model.tokenizer.model={TOKENIZER}",
        "trainer.precision=32",
        "exp_manager.save_hf=true",
        f"model.global_batch_size={GLOBAL_BATCH}",
        "model.micro_batch_size=2",
        "model.data.shuffle=false",
        f"model.data.max_length={MAX_LENGTH}",
        "model.data.data_prefix.validation=[]",
    ]
    log_dir = root / "run"
    tp2 = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
    run_script(
        KTO_SCRIPT,
        [*common, *tp2, f"exp_manager.explicit_log_dir={log_dir}", "trainer.kto.max_steps=1"],
        nproc=2,
    )
    lora = [
        "model.peft.peft_scheme=lora",
        "model.peft.lora_tuning.adapter_dim=4",
        "model.peft.lora_tuning.alpha=8",
        "model.peft.lora_tuning.target_modules=[all]",
        "model.optim.lr=1e-2",
        "exp_manager.save_hf_merged=true",
        "trainer.kto.max_steps=2",
    ]
    run_script(KTO_SCRIPT, [*common, *lora, f"exp_manager.explicit_log_dir={root / 'lora'}"])
    return root, model, tok, read_metrics(log_dir)[0]


def test_first_step_logprobs_equal_transformers(run):
    from megatron_kto.data.dataset import build_kto_dataset

    _, model, tok, first = run
    dataset, _ = build_kto_dataset([TRAIN_DATA], tok, MAX_LENGTH, use_cache=False)
    sums = {True: [], False: []}
    longest = 0
    with torch.no_grad():
        for i in range(GLOBAL_BATCH):  # sequential order: the first global batch
            item = dataset[i]
            prompt, completion = list(item["prompt_ids"]), list(item["completion_ids"])
            tokens = torch.tensor([prompt + completion])
            longest = max(longest, tokens.shape[1])
            logp = torch.log_softmax(model(tokens).logits[0, :-1].double(), dim=-1)
            per_token = logp.gather(-1, tokens[0, 1:, None])[:, 0]
            sums[bool(item["label"])].append(per_token[len(prompt) - 1 :].sum().item())
    assert longest > model.config.sliding_window, "rows longer than the window"
    assert sums[True] and sums[False], "the first batch must hold both classes"
    chosen = sum(sums[True]) / len(sums[True])
    rejected = sum(sums[False]) / len(sums[False])
    print(f"logps/chosen {first['logps/chosen']} vs {chosen}; rejected {first['logps/rejected']}")
    assert first["logps/chosen"] == pytest.approx(chosen, rel=RTOL)
    assert first["logps/rejected"] == pytest.approx(rejected, rel=RTOL)


def test_hf_output_loads_and_generates(run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, model, _, _ = run
    out = root / "run" / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["layer_types"] == model.config.layer_types
    trained = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(trained).__name__ == "Gemma3ForCausalLM"
    original = load_file(root / "hf" / "model.safetensors")
    state = trained.state_dict()
    moved = [k for k in original if not torch.equal(original[k], state[k])]
    assert len(moved) == len(original)  # one Adam step changes every tensor
    prompt = torch.tensor([[1, 5, 9, 13]])
    generated = trained.generate(prompt, max_new_tokens=12, do_sample=False)
    assert generated.shape == (1, 16) and torch.equal(generated[:, :4], prompt)


def test_lora_adapter_loads_in_peft_under_hf_names(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, _, _, _ = run
    adapter = root / "lora" / "hf"
    config = json.loads((adapter / "adapter_config.json").read_text())
    targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert set(config["target_modules"]) == targets
    tokens = torch.tensor([[1, *range(5, 40)]])  # longer than the window
    base = AutoModelForCausalLM.from_pretrained(root / "hf").eval()
    with torch.no_grad():
        base_logits = base(tokens).logits
        peft_logits = PeftModel.from_pretrained(base, adapter).eval()(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(root / "lora" / "hf_merged").eval()
        merged_logits = merged(tokens).logits
    moved = (peft_logits - base_logits).abs().max().item()
    diff = (peft_logits - merged_logits).abs().max().item()
    print(f"LoRA: |peft - base| {moved:.2e}, |peft - merged| {diff:.2e}")
    assert moved > 1e-2 and diff <= 1e-5
