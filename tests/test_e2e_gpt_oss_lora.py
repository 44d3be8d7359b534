"""A LoRA KTO run on a tiny GPT-OSS straight from its Hugging Face directory, at EP=2 (two ranks,
biased experts at expert TP 1), adapters on q/k/v/o (Hugging Face target names), writing `hf/`
(the PEFT adapter) and `hf_merged/` (the merged model). Shown: the run trains (step-1 loss is
KTO's 0.5 plus the router aux term, step 2 moves), `peft` loads the adapter onto the base
`GptOssForCausalLM`, and that model's logits equal the merged export's.
"""

from __future__ import annotations

import json

import pytest
import torch
from e2e_cli import KTO_SCRIPT, QUIET, read_metrics, run_script
from hf_tiny import make_tokenizer, write_kto_rows
from test_gpt_oss import _hf_config

pytestmark = pytest.mark.e2e
pytest.importorskip("peft")


def test_lora_run_writes_an_adapter_peft_loads(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = _hf_config()
    config.vocab_size = make_tokenizer(tmp_path / "hf")
    config.bos_token_id, config.eos_token_id = 1, 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    write_kto_rows(tmp_path / "train.jsonl", 0, 32)
    run_script(
        KTO_SCRIPT,
        [
            *QUIET,
            f"pretrained_checkpoint.restore_from_path={tmp_path / 'hf'}",
            f"model.data.data_prefix.train=[{tmp_path / 'train.jsonl'}]",
            "model.data.data_prefix.validation=[]",
            "trainer.precision=32",
            f"exp_manager.explicit_log_dir={tmp_path / 'run'}",
            "trainer.kto.max_steps=2",
            "model.global_batch_size=8",
            "model.micro_batch_size=4",
            "model.optim.lr=1e-2",
            "model.optim.sched.name=Constant",
            "model.optim.sched.warmup_steps=0",
            "model.expert_model_parallel_size=2",
            "model.peft.peft_scheme=lora",
            "model.peft.lora_tuning.adapter_dim=4",
            "model.peft.lora_tuning.alpha=16",
            "model.peft.lora_tuning.target_modules=[q_proj,k_proj,v_proj,o_proj]",
            "exp_manager.save_hf=true",
            "exp_manager.save_hf_merged=true",
        ],
        nproc=2,
        timeout=600,
    )
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["loss"] == pytest.approx(0.5 + config.router_aux_loss_coef * rows[0]["aux_loss"])
    assert rows[1]["rewards/chosen"] != 0.0
    adapter = json.loads((tmp_path / "run" / "hf" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, tmp_path / "run" / "hf").eval()
    merged = AutoModelForCausalLM.from_pretrained(
        tmp_path / "run" / "hf_merged", dtype=torch.float32
    ).eval()
    tokens = torch.randint(
        0, config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        a, b = adapted(tokens).logits, merged(tokens).logits
    assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()
