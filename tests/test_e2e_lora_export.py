"""A LoRA run goes out as a Hugging Face PEFT adapter (or merged weights) and comes back in.

A tiny `transformers` Llama with grouped-query attention and its tokenizer (`hf_tiny`) is
imported with `tools/convert_checkpoint.py`; `examples/train_gpt_kto.py` trains LoRA adapters
on every projection for 2 steps (lr 1e-2: every adapter is far from its initialisation). Then:

* `export --ckpt <run>` writes an adapter directory that `peft.PeftModel.from_pretrained` loads
  onto the original HF model; its logits equal our model's (base + the run's adapters, rebuilt
  from the adapter-only checkpoint) to 1e-5, and differ from the base model's by O(0.1);
* `export --merge-lora` writes a plain HF model whose logits equal the PEFT model's;
* a new run started from the exported adapter (`model.peft.restore_from_path`) with
  `model.peft.reference=base` sees it: its step-1 rewards are non-zero (policy = base +
  adapter, reference = base); with lr 1e-30 its one
  step leaves the adapter bit-identical, and exporting it again reproduces the adapter files
  bit for bit (import -> export is the identity);
* `tools/eval_kto_rewards.py --policy <LoRA run>` scores policy = base + adapters against
  reference = base (adapters off): its log-probs equal those of the merged export imported
  back as a plain checkpoint and scored against the base checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from e2e_cli import EVAL_TOOL, KTO_SCRIPT, QUIET, REPO, read_metrics, run_script
from hf_tiny import make_hf_chat_model, write_kto_rows
from multirank import run_multirank

pytestmark = pytest.mark.e2e

TOOL = REPO / "tools" / "convert_checkpoint.py"
TOLERANCE = 1e-5


def _train(root: Path, log_dir: Path, extra: list[str]) -> None:
    run_script(
        KTO_SCRIPT,
        [
            *QUIET,
            f"pretrained_checkpoint.restore_from_path={root / 'mcore'}",
            f"model.data.data_prefix.train=[{root / 'train.jsonl'}]",
            "model.data.data_prefix.validation=[]",
            "trainer.precision=32",
            f"exp_manager.explicit_log_dir={log_dir}",
            "trainer.kto.max_steps=2",
            "model.global_batch_size=8",
            "model.micro_batch_size=4",
            "model.optim.sched.name=Constant",
            "model.optim.sched.warmup_steps=0",
            "model.peft.peft_scheme=lora",
            "model.peft.lora_tuning.adapter_dim=4",
            "model.peft.lora_tuning.alpha=16",
            "model.peft.lora_tuning.target_modules=[q_proj,k_proj,v_proj,o_proj,mlp]",
            *extra,
        ],
    )


def _tokens() -> torch.Tensor:
    return torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(3))


def _ours_worker(rank: int, world_size: int, run_dir: str) -> torch.Tensor:
    from megatron_kto.checkpointing.locate import resolve_pretrained_dir
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
    from megatron_kto.peft.checkpoint import build_lora_model
    from megatron_kto.runtime import init_runtime, teardown

    rt = init_runtime(1, 1, seed=0)
    ckpt = resolve_pretrained_dir(run_dir)
    arch = read_architecture(ckpt)
    chunks = build_gpt_chunks(arch, ParallelLayout(), rt.device)
    build_lora_model(ckpt, chunks, arch)
    model = unwrap(chunks[0]).eval()
    tokens = _tokens()
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    teardown()
    return logits[..., : arch.vocab_size].clone()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_export")
    make_hf_chat_model(root / "hf")
    write_kto_rows(root / "train.jsonl", 0, 64)
    run_script(TOOL, ["import", "--hf-dir", str(root / "hf"), "--out", str(root / "mcore")])
    _train(root, root / "run", ["model.optim.lr=1e-2"])
    run_script(TOOL, ["export", "--ckpt", str(root / "run"), "--out", str(root / "adapter")])
    merge = ["export", "--ckpt", str(root / "run"), "--out", str(root / "merged"), "--merge-lora"]
    run_script(TOOL, merge)
    _train(
        root,
        root / "again",
        [
            "model.optim.lr=1e-30",
            f"model.peft.restore_from_path={root / 'adapter'}",
            "model.peft.reference=base",
        ],
    )
    run_script(TOOL, ["export", "--ckpt", str(root / "again"), "--out", str(root / "adapter2")])
    ours = run_multirank(_ours_worker, 1, str(root / "run"), timeout=180)[0]
    merged_ckpt = ["import", "--hf-dir", str(root / "merged"), "--out", str(root / "mcore_merged")]
    run_script(TOOL, merged_ckpt)
    data = ["--data", str(root / "train.jsonl"), "--no-cache"]
    run_script(EVAL_TOOL, ["--policy", str(root / "run"), *data, "--per-example", f"{root}/e1"])
    plain = [
        *("--policy", str(root / "mcore_merged"), "--reference", str(root / "mcore")),
        *("--beta", "0.1", "--max-length", "128", "--tokenizer-library", "huggingface"),
        *("--tokenizer", str(root / "mcore")),
    ]
    run_script(EVAL_TOOL, [*plain, *data, "--per-example", f"{root}/e2"])
    return root, ours


def test_peft_loads_the_adapter_with_our_logits(exported):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, ours = exported
    base = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(_tokens()).logits
    model = PeftModel.from_pretrained(base, root / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        adapted = model(_tokens()).logits
        merged_logits = merged(_tokens()).logits
    effect = (adapted - plain).abs().max().item()
    diff, merged_diff = ((x - adapted).abs().max().item() for x in (ours, merged_logits))
    print(
        f"\nadapter effect {effect:.3f}; ours vs peft {diff:.2e}; merged vs peft {merged_diff:.2e}"
    )
    assert effect > 0.05
    assert diff <= TOLERANCE and merged_diff <= TOLERANCE
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert (config["r"], config["lora_alpha"]) == (4, 16.0)


def test_imported_adapter_trains_from_where_it_was(exported):
    from safetensors.torch import load_file

    root, _ = exported
    first = read_metrics(root / "again")[0]
    assert first["rewards/chosen"] != 0.0 and first["rewards/rejected"] != 0.0
    a = load_file(str(root / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(root / "adapter2" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_tool_scores_the_lora_run_against_its_base(exported):
    root, _ = exported
    lora, merged = (
        [json.loads(line) for line in (root / name).read_text().splitlines()]
        for name in ("e1", "e2")
    )
    assert len(lora) == len(merged) == 64
    for key in ("policy_logps", "reference_logps"):
        a = torch.tensor([r[key] for r in lora], dtype=torch.float64)
        b = torch.tensor([r[key] for r in merged], dtype=torch.float64)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-4), (key, (a - b).abs().max())
    assert max(abs(r["reward"]) for r in lora) > 1e-2  # the adapters matter
