"""A LoRA run trained in bf16 (`trainer.precision=bf16`) exports with `--merge-lora`.

The run's frozen base is held in bf16, so its base fingerprint is of the bf16 weights; the
export rebuilds the base in float32 and checks it rounded to the run's dtype
(`peft.checkpoint.build_lora_model`). Before, that check compared float32 sums with the bf16
ones and refused the run ("its adapters were trained on another base model").

One tiny run (the `hf_tiny` Llama with grouped-query attention, 2 steps, adapters on every
projection), then both exports. The merged directory's weights equal `peft`'s
`merge_and_unload` of the adapter directory on the original Hugging Face model (float32 base +
the run's adapters, `peft.merge.merge_lora`'s numbers) and differ from the base.
"""

from __future__ import annotations

import pytest
import torch
from e2e_cli import KTO_SCRIPT, QUIET, REPO, run_script
from hf_tiny import make_hf_chat_model, write_kto_rows

pytestmark = pytest.mark.e2e

TOOL = REPO / "tools" / "convert_checkpoint.py"


def test_bf16_lora_run_exports_merged_weights(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    make_hf_chat_model(tmp_path / "hf", kv_heads=2)
    write_kto_rows(tmp_path / "train.jsonl", 0, 16)
    run_script(TOOL, ["import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "mcore")])
    run_script(
        KTO_SCRIPT,
        [
            *QUIET,
            f"pretrained_checkpoint.restore_from_path={tmp_path / 'mcore'}",
            f"model.data.data_prefix.train=[{tmp_path / 'train.jsonl'}]",
            "model.data.data_prefix.validation=[]",
            "trainer.precision=bf16",
            f"exp_manager.explicit_log_dir={tmp_path / 'run'}",
            "trainer.kto.max_steps=2",
            "model.global_batch_size=4",
            "model.micro_batch_size=4",
            "model.optim.lr=1e-2",
            "model.optim.sched.name=Constant",
            "model.optim.sched.warmup_steps=0",
            "model.peft.peft_scheme=lora",
            "model.peft.lora_tuning.adapter_dim=4",
            "model.peft.lora_tuning.alpha=16",
            "model.peft.lora_tuning.target_modules=[q_proj,k_proj,v_proj,o_proj,mlp]",
        ],
    )
    run = str(tmp_path / "run")
    run_script(TOOL, ["export", "--ckpt", run, "--out", str(tmp_path / "adapter")])
    proc = run_script(
        TOOL, ["export", "--ckpt", run, "--out", str(tmp_path / "merged"), "--merge-lora"]
    )
    assert "(LoRA merged)" in proc.stdout

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    want = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    got = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert got.keys() <= want.keys() and "model.layers.0.self_attn.k_proj.weight" in got
    worst = max((got[k].float() - want[k]).abs().max().item() for k in got)
    moved = max((got[k].float() - before[k]).abs().max().item() for k in got)
    print(f"\nmerged vs peft merge_and_unload {worst:.2e}; adapters moved weights by {moved:.2e}")
    assert worst <= 1e-6
    assert moved > 1e-3
