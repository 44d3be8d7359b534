"""A KTO run started from a converted Hugging Face model sees exactly the model `transformers` sees.

A tiny random `transformers` Llama with the bundled tokenizer's vocabulary is imported with
`tools/convert_checkpoint.py`, then `examples/train_gpt_kto.py` trains one step from it
(`pretrained_checkpoint.restore_from_path`, sequential data order). The first step's
`logps/chosen` / `logps/rejected` (mean summed completion log-probs of the desirable /
undesirable rows, computed before the update) must equal the same numbers computed with the
`transformers` model directly on the same rows. The trained run is then exported back to a
Hugging Face directory (found through the run's config) that `transformers` loads.
"""

from __future__ import annotations

import json

import pytest
import torch
from e2e_cli import KTO_SCRIPT, QUIET, REPO, TOKENIZER, TRAIN_DATA, read_metrics, run_script

pytestmark = pytest.mark.e2e

GLOBAL_BATCH, MAX_LENGTH = 8, 64
RTOL = 1e-4


def _hf_model(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=128,
        initializer_range=0.1,  # far from uniform next-token distributions
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_kto.data.tokenizers import load_tokenizer

    root = tmp_path_factory.mktemp("converted")
    tok = load_tokenizer("sentencepiece", str(TOKENIZER))
    model = _hf_model(tok.vocab_size)
    model.save_pretrained(root / "hf")
    tool = REPO / "tools" / "convert_checkpoint.py"
    run_script(tool, ["import", "--hf-dir", str(root / "hf"), "--out", str(root / "mcore")])
    log_dir = root / "run"
    run_script(
        KTO_SCRIPT,
        [
            *QUIET,
            f"pretrained_checkpoint.restore_from_path={root / 'mcore'}",
            # A real run: the data and tokenizer are named (the converted directory holds no
            # tokenizer), fp32 for an exact comparison; the rest are the real-run defaults.
            f"model.data.data_prefix.train=[{TRAIN_DATA}]",
            "model.tokenizer.library=sentencepiece",
            f"model.tokenizer.model={TOKENIZER}",
            "trainer.precision=32",
            f"exp_manager.explicit_log_dir={log_dir}",
            "trainer.kto.max_steps=1",
            f"model.global_batch_size={GLOBAL_BATCH}",
            "model.micro_batch_size=2",
            "model.data.shuffle=false",
            f"model.data.max_length={MAX_LENGTH}",
            "model.data.data_prefix.validation=[]",
        ],
    )
    run_script(tool, ["export", "--ckpt", str(log_dir), "--out", str(root / "export")])
    return root, model, tok, read_metrics(log_dir)[0]


def test_first_step_logprobs_equal_transformers(run):
    from megatron_kto.data.dataset import build_kto_dataset

    _, model, tok, first = run
    dataset, _ = build_kto_dataset([TRAIN_DATA], tok, MAX_LENGTH, use_cache=False)
    sums = {True: [], False: []}
    with torch.no_grad():
        for i in range(GLOBAL_BATCH):  # sequential order: the first global batch
            item = dataset[i]
            prompt, completion = list(item["prompt_ids"]), list(item["completion_ids"])
            tokens = torch.tensor([prompt + completion])
            logp = torch.log_softmax(model(tokens).logits[0, :-1].double(), dim=-1)
            targets = tokens[0, 1:]
            per_token = logp.gather(-1, targets[:, None])[:, 0]
            sums[bool(item["label"])].append(per_token[len(prompt) - 1 :].sum().item())
    assert sums[True] and sums[False], "the first batch must hold both classes"
    chosen = sum(sums[True]) / len(sums[True])
    rejected = sum(sums[False]) / len(sums[False])
    assert first["logps/chosen"] == pytest.approx(chosen, rel=RTOL)
    assert first["logps/rejected"] == pytest.approx(rejected, rel=RTOL)
    assert first["rewards/chosen"] == 0.0  # policy == reference before the first update


def test_trained_run_exports_to_transformers(run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, model, _, _ = run
    config = json.loads((root / "export" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == model.config.vocab_size
    exported = AutoModelForCausalLM.from_pretrained(root / "export")
    original = load_file(root / "hf" / "model.safetensors")
    trained = exported.state_dict()
    assert set(original) <= set(trained)
    moved = [k for k in original if not torch.equal(original[k], trained[k])]
    assert len(moved) == len(original)  # one Adam step changes every tensor
