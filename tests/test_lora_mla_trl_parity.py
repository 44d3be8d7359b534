"""KTO with LoRA on multi-latent attention against TRL 1.16's `KTOTrainer` + `peft`, and the run's
Hugging Face outputs.

The model is `test_deepseek_v3_trl_parity.py`'s tiny DeepSeek-V3 (a query bottleneck, YaRN, a
dense first layer then sigmoid-routed experts). A `peft` adapter (rank 4, alpha 8, dropout 0) on
every attention projection by its Hugging Face name — q_a_proj, q_b_proj, kv_a_proj_with_mqa,
kv_b_proj, o_proj — with a non-zero B is the starting adapter of both sides, with the base model
(adapters off) as the reference: TRL gets `peft_config` and the starting weights, ours
`model.peft.restore_from_path` and `model.peft.reference=base` (`trl_harness.LoRARun`,
`trl_lora_trajectory`). Ours loads the Hugging Face directory directly and writes `hf/` (the
adapter directory) and `hf_merged/` (`exp_manager.save_hf_merged`).

Shown: 4 steps' losses equal TRL's to 1e-5 relative; the final adapter (`hf/`) equals TRL's to
fp32 round-off and moved well beyond it; `peft` applies `hf/` onto the source model with the
logits of our merged `hf_merged/`, which differs from the source in the adapted projections only.
"""

from __future__ import annotations

import pytest
import torch
from e2e_cli import read_metrics
from hf_tiny import write_kto_rows
from test_deepseek_v3_trl_parity import _make_deepseek
from trl_harness import LoRARun, our_lora_run, start_adapter, trl_lora_trajectory

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")
pytest.importorskip("peft")

STEPS, BATCH = 4, 8
LORA = LoRARun(("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
LOSS_RTOL, WEIGHT_RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("lora_mla_trl")
    _make_deepseek(root / "hf")
    write_kto_rows(root / "train.jsonl", 0, 64)
    adapter = start_adapter(root, LORA)
    outputs = ["exp_manager.save_hf=true", "exp_manager.save_hf_merged=true"]
    extra = ["model.peft.reference=base", *outputs]
    our_lora_run(root, "ours", LORA, adapter, STEPS, BATCH, extra, start="hf")
    trl_losses, trl_state = trl_lora_trajectory(root, adapter, "base", LORA, STEPS, BATCH)
    start = load_file(str(adapter / "adapter_model.safetensors"))
    return root, read_metrics(root / "ours"), trl_losses, trl_state, start


def test_step_losses_equal_trl(runs):
    _, metrics, trl_losses, _, _ = runs
    ours = [r["loss"] for r in metrics]
    print(f"\nours {ours}\ntrl  {trl_losses}")
    assert len(ours) == len(trl_losses) == STEPS
    assert metrics[0]["rewards/chosen"] != 0.0  # the starting adapter is not the reference
    assert ours == pytest.approx(trl_losses, rel=LOSS_RTOL)


def test_final_adapter_equals_trl(runs):
    from safetensors.torch import load_file

    root, _, _, theirs, start = runs
    ours = load_file(str(root / "ours" / "hf" / "adapter_model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert {k.split(".")[-3] for k in ours} == set(LORA.targets)
    worst = max(float((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()) for k in theirs)
    moved = min(float((theirs[k] - start[k]).abs().max() / start[k].abs().max()) for k in theirs)
    print(f"\nadapters max rel diff vs TRL {worst:.1e}; smallest move {moved:.1e}")
    assert moved > 10 * WEIGHT_RTOL
    assert worst <= WEIGHT_RTOL


def test_peft_applies_the_adapter_as_our_merged_model(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = runs[0]
    base = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    vocab = base.config.vocab_size
    tokens = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    source = {k: v.clone() for k, v in base.state_dict().items()}
    with torch.no_grad():
        before = base(tokens).logits
        adapted = PeftModel.from_pretrained(base, root / "ours" / "hf").eval()(tokens).logits
        merged_model = AutoModelForCausalLM.from_pretrained(
            root / "ours" / "hf_merged", dtype=torch.float32
        )
        merged = merged_model(tokens).logits
    assert (adapted - before).abs().max() > 1e-3
    torch.testing.assert_close(adapted, merged, rtol=1e-5, atol=1e-5)
    changed = {
        k.split(".")[-2]
        for k, v in merged_model.state_dict().items()
        if not torch.equal(v, source[k])
    }
    assert changed == set(LORA.targets)
