"""KTO with LoRA against TRL 1.16's `KTOTrainer` + `peft`: same steps, same adapters, for both
reference policies of a run that starts from an imported adapter.

One tiny `transformers` Llama with grouped-query attention and its tokenizer (`hf_tiny`) is the
base of both runs. A `peft` LoRA adapter (rank 4, alpha 8, every projection, dropout 0) is made
on it with a non-zero B and saved; that directory is the starting adapter of both sides:

* `model.peft.reference=start` (our default): the reference is the starting policy, base + a
  frozen copy of the starting adapter. TRL 1.16 does that when handed an already wrapped
  `PeftModel` (`PeftModel.from_pretrained(..., is_trainable=True)`, no `peft_config`, no
  `ref_model`): it adds a "ref" adapter copied from "default" and computes the reference with it.
  Step 1's policy is the reference, so its loss is 0.5 and its rewards and KL 0, exactly;
* `model.peft.reference=base`: the reference is the base (adapters off). TRL:
  `KTOTrainer(model=base, peft_config=<the adapter's LoraConfig>)`, whose fresh adapter is then
  overwritten with the starting adapter's weights (`set_peft_model_state_dict`); no `ref_model`,
  so TRL's reference is the model with the adapter disabled. Step 1's rewards are non-zero.

Batches are taken in data order (a `SequentialSampler`, as our `model.data.shuffle=false`), each
batch's rows in reverse order: TRL 1.16's collator pairs prompt i with the completion of row
i-1, ours with row i+1 (DESIGN §1), so reversed batches give both sides the same set of KL rows.
Ours is `examples/train_gpt_kto.py` from the imported base with
`model.peft.restore_from_path=<adapter>`, then `tools/convert_checkpoint.py export` of the run.

Same data (64 rows), β, λ_D/λ_U, constant lr 1e-3, Adam (β 0.9/0.999, ε 1e-5 — see
`test_e2e_lora.py` for why ε above round-off), gradient clip 1.0 and batch of 8 for 4 steps.
Step-by-step losses and the final adapter weights must agree to fp32 round-off.

Resume (reference=start): 2 steps, then the starting adapter *file* is replaced by another one,
then the run resumes to step 4. The frozen copy comes back from the checkpoint (not from the
changed file), so the losses and the final adapter equal the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from e2e_cli import REPO, read_metrics, run_script
from hf_tiny import make_hf_chat_model, write_kto_rows
from trl_harness import LoRARun, our_lora_run, start_adapter, trl_lora_trajectory

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")
pytest.importorskip("peft")

TOOL = REPO / "tools" / "convert_checkpoint.py"
STEPS, BATCH, ROWS = 4, 8, 64
LORA = LoRARun(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4


def _ours(root: Path, name: str, adapter: Path, extra: list[str]) -> None:
    our_lora_run(root, name, LORA, adapter, STEPS, BATCH, extra)


def _exported(root: Path, run: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = root / f"{run}_exported"
    run_script(TOOL, ["export", "--ckpt", str(root / run), "--out", str(out)])
    return load_file(str(out / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora_trl")
    make_hf_chat_model(root / "hf")
    write_kto_rows(root / "train.jsonl", 0, ROWS)
    start_adapter(root, LORA)
    run_script(TOOL, ["import", "--hf-dir", str(root / "hf"), "--out", str(root / "mcore")])
    return root


@pytest.fixture(scope="module")
def ours_start(prepared) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Our run with the default reference (start): metrics and exported adapter."""
    _ours(prepared, "ours_start", prepared / "adapter0", [])
    return read_metrics(prepared / "ours_start"), _exported(prepared, "ours_start")


@pytest.fixture(scope="module", params=["start", "base"])
def runs(request, prepared):
    from safetensors.torch import load_file

    root, reference = prepared, request.param
    adapter = root / "adapter0"
    if reference == "start":
        metrics, ours = request.getfixturevalue("ours_start")
    else:
        _ours(root, "ours_base", adapter, ["model.peft.reference=base"])
        metrics, ours = read_metrics(root / "ours_base"), _exported(root, "ours_base")
    trl_losses, trl_state = trl_lora_trajectory(root, adapter, reference, LORA, STEPS, BATCH)
    start = load_file(str(adapter / "adapter_model.safetensors"))
    return reference, metrics, ours, trl_losses, trl_state, start


def test_step_losses_equal_trl(runs):
    reference, metrics, _, trl_losses, _, _ = runs
    ours = [r["loss"] for r in metrics]
    print(f"\n{reference}: ours {ours}\ntrl  {trl_losses}\nkl {[r['kl'] for r in metrics]}")
    assert len(ours) == len(trl_losses) == STEPS
    first = metrics[0]
    if reference == "start":  # step 1's policy is the reference
        assert (first["loss"], first["kl"]) == (0.5, 0.0)
        assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0
        assert metrics[-1]["rewards/chosen"] != 0.0
    else:  # the starting adapter is not the base
        assert first["rewards/chosen"] != 0.0 and first["loss"] != 0.5
    assert ours == pytest.approx(trl_losses, rel=LOSS_RTOL)


def test_final_adapters_equal_trl(runs):
    reference, _, ours, _, theirs, start = runs
    assert ours.keys() == theirs.keys()
    worst = max(float((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()) for k in theirs)
    moved = min(float((theirs[k] - start[k]).abs().max() / start[k].abs().max()) for k in theirs)
    print(f"\n{reference}: adapters max rel diff vs TRL {worst:.1e}; smallest move {moved:.1e}")
    assert moved > 10 * WEIGHT_RTOL
    assert worst <= WEIGHT_RTOL


def test_resume_restores_the_frozen_starting_adapter(prepared, ours_start):
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint import FileSystemReader

    root, (full_metrics, full_adapter) = prepared, ours_start
    adapter = root / "adapter_resume"
    shutil.copytree(root / "adapter0", adapter)
    _ours(root, "resumed", adapter, [f"trainer.kto.max_steps={STEPS // 2}"])
    ckpt = root / "resumed" / "checkpoints" / f"step_{STEPS // 2}"
    keys = list(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    assert any(k.endswith(".ref_B") for k in keys) and any(k.endswith(".ref_A") for k in keys)
    # Another starting adapter in the file: only the checkpoint can give back the first one.
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    save_file({k: 2 * v for k, v in weights.items()}, str(adapter / "adapter_model.safetensors"))
    _ours(root, "resumed", adapter, [])
    losses = [r["loss"] for r in read_metrics(root / "resumed")]
    assert len(losses) == STEPS and losses == [r["loss"] for r in full_metrics]
    resumed = _exported(root, "resumed")
    assert resumed.keys() == full_adapter.keys()
    assert all(torch.equal(resumed[k], full_adapter[k]) for k in resumed)


def test_precomputed_reference_is_the_starting_policy(prepared, ours_start):
    """`reference_policy=precomputed` computes its table with the frozen starting adapter too:
    the same steps as the adapters-off reference (step 1 is the reference: rewards 0)."""
    root, (full_metrics, _) = prepared, ours_start
    _ours(root, "precomputed", root / "adapter0", ["model.kto.reference_policy=precomputed"])
    metrics = read_metrics(root / "precomputed")
    first = metrics[0]
    print(f"\nprecomputed step 1: {first['loss']}, rewards {first['rewards/chosen']}")
    assert abs(first["rewards/chosen"]) <= 1e-6 and abs(first["rewards/rejected"]) <= 1e-6
    ours = [r["loss"] for r in metrics]
    assert ours == pytest.approx([r["loss"] for r in full_metrics], rel=LOSS_RTOL)
