"""KTO runs on a tiny GPT-OSS straight from its Hugging Face directory, two ranks.

* Full fine-tuning, 3 steps: TP=2 x SP x EP=2 (expert TP 1) trains the steps of EP=2 (loss,
  grad norm, log-probs <= 1e-5 relative) — megatron-core 0.16.1 reduced the experts' fc2 bias
  gradients over TP under SP and left TP rank 1's out of the gradient norm
  (`layer_options.ExpertRowParallelLinear`).
* LoRA at EP=2, adapters on q/k/v/o (Hugging Face target names), writing `hf/` (the PEFT adapter)
  and `hf_merged/`: the run trains (step-1 loss is KTO's 0.5 plus the router aux term), `peft`
  loads the adapter onto the base `GptOssForCausalLM`, and that model's logits equal the merged
  export's.
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


def _model(tmp_path):
    from transformers import AutoModelForCausalLM

    config = _hf_config()
    config.vocab_size = make_tokenizer(tmp_path / "hf")
    config.bos_token_id, config.eos_token_id = 1, 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sinks" in name or name.endswith("router.weight"):
                p.normal_(0.0, 1.0)  # sinks that matter; routing far from ties
    model.save_pretrained(tmp_path / "hf")
    write_kto_rows(tmp_path / "train.jsonl", 0, 32)
    return config


def _run(tmp_path, name: str, steps: int, extra: list[str], lr: float = 1e-2) -> list[dict]:
    run_script(
        KTO_SCRIPT,
        [
            *QUIET,
            f"pretrained_checkpoint.restore_from_path={tmp_path / 'hf'}",
            f"model.data.data_prefix.train=[{tmp_path / 'train.jsonl'}]",
            "model.data.data_prefix.validation=[]",
            "trainer.precision=32",
            f"exp_manager.explicit_log_dir={tmp_path / name}",
            f"trainer.kto.max_steps={steps}",
            "model.global_batch_size=8",
            "model.micro_batch_size=4",
            f"model.optim.lr={lr}",
            "model.optim.sched.name=Constant",
            "model.optim.sched.warmup_steps=0",
            "model.expert_model_parallel_size=2",
            *extra,
        ],
        nproc=2,
        timeout=600,
    )
    return read_metrics(tmp_path / name)


def test_tp2_sp_ep2_trains_the_steps_of_ep2(tmp_path):
    _model(tmp_path)
    # lr 1e-3: at 1e-2 step 2's grad norm differed by 1.8e-5 relative (loss by 4e-6), presumably
    # round-off amplified by Adam's first step, which moves every weight by ~lr whatever the size
    # of its gradient (TP sums in another order); not established.
    ep2 = _run(tmp_path, "ep2", 3, [], lr=1e-3)
    tp2 = _run(
        tmp_path,
        "tp2",
        3,
        [
            "model.tensor_model_parallel_size=2",
            "model.sequence_parallel=true",
            "model.expert_tensor_parallel_size=1",
        ],
        lr=1e-3,
    )
    for a, b in zip(ep2, tp2, strict=True):
        for key in ("loss", "grad_norm", "aux_loss", "logps/chosen", "logps/rejected"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)


def test_lora_run_writes_an_adapter_peft_loads(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = _model(tmp_path)
    lora = [
        "model.peft.peft_scheme=lora",
        "model.peft.lora_tuning.adapter_dim=4",
        "model.peft.lora_tuning.alpha=16",
        "model.peft.lora_tuning.target_modules=[q_proj,k_proj,v_proj,o_proj]",
        "exp_manager.save_hf=true",
        "exp_manager.save_hf_merged=true",
    ]
    rows = _run(tmp_path, "run", 2, lora)
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
