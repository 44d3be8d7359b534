"""NeMo-Aligner's RPO losses (`rpo_sq`, `rpo_fwd_kl`, `rpo_bwd_kl`) against hand-worked numbers,
and the data path of their rewards (rows → shards → collate; one-line errors).

NeMo-Aligner's formulas (`megatron_gpt_dpo_model.py`, written here from them): h = (π_c − ref_c) −
(π_r − ref_r), x = β·h, g = gt_reward_scale × (chosen reward − rejected reward):
rpo_sq (x − g)²; rpo_fwd_kl Σ± σ(±x)(log σ(±x) − log σ(±g)); rpo_bwd_kl Σ± σ(±g)(log σ(±g) −
log σ(±x)). Two pairs, float64, β = 0.5, scale 2:

    pair  π_c  π_r  ref_c  ref_r  R_c  R_r   h     x      g
    1     −3   −5   −3.5   −4.5   0.8  0.3   1     0.5    1
    2     −6   −4   −5     −4.5   0.1  0.6   −1.5  −0.75  −1

- rpo_sq: (0.5 − 1)² = 0.25; (−0.75 + 1)² = 0.0625.
- rpo_fwd_kl, pair 1: σ(0.5) = 0.622459, σ(1) = 0.731059:
  0.622459·log(0.622459/0.731059) + 0.377541·log(0.377541/0.268941)
  = −0.100103 + 0.128058 = 0.027955; pair 2: 0.006596.
- rpo_bwd_kl, pair 1: 0.731059·log(0.731059/0.622459) + 0.268941·log(0.268941/0.377541)
  = 0.117576 − 0.091231 = 0.026345; pair 2: 0.006374.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_kto.config.validate import ConfigError
from megatron_kto.losses.dpo import dpo_loss, dpo_total_loss

F64 = torch.float64
PC, PR = torch.tensor([-3.0, -6.0], dtype=F64), torch.tensor([-5.0, -4.0], dtype=F64)
RC, RR = torch.tensor([-3.5, -5.0], dtype=F64), torch.tensor([-4.5, -4.5], dtype=F64)
G = 2.0 * (torch.tensor([0.8, 0.1], dtype=F64) - torch.tensor([0.3, 0.6], dtype=F64))


@pytest.mark.parametrize(
    "loss_type,expected",
    [
        ("rpo_sq", [0.25, 0.0625]),
        ("rpo_fwd_kl", [0.027955038, 0.006596007]),
        ("rpo_bwd_kl", [0.026344586, 0.006373963]),
    ],
)
def test_hand_values(loss_type, expected):
    out = dpo_total_loss(PC, PR, RC, RR, 0.5, loss_type=loss_type, reward_margins=G)
    torch.testing.assert_close(
        out.per_example, torch.tensor(expected, dtype=F64), atol=1e-9, rtol=0
    )
    torch.testing.assert_close(out.chosen_rewards, 0.5 * (PC - RC))  # DPO's implicit rewards


def test_kl_forms_with_one_reward_gap_are_exo_and_conservative_dpo():
    """With the same g for every pair, rpo_fwd_kl is exo_pair at ε = σ(−g), and rpo_bwd_kl is
    conservative sigmoid at that ε minus the entropy of σ(g) (a constant): the same gradient."""
    beta, g = 0.3, 1.2
    eps = 1.0 / (1.0 + math.exp(g))
    pc = torch.tensor([-3.0, -7.5, -2.0], dtype=F64, requires_grad=True)
    pr, rc, rr = (torch.tensor(v, dtype=F64) for v in
                  ([-4.0, -6.0, -9.0], [-3.5, -7.0, -2.5], [-3.0, -6.5, -8.0]))  # fmt: skip
    margins = torch.full((3,), g, dtype=F64)
    fwd = dpo_loss(pc, pr, rc, rr, beta, "rpo_fwd_kl", reward_margins=margins).losses
    bwd = dpo_loss(pc, pr, rc, rr, beta, "rpo_bwd_kl", reward_margins=margins).losses
    exo = dpo_loss(pc, pr, rc, rr, beta, "exo_pair", label_smoothing=eps).losses
    sig = dpo_loss(pc, pr, rc, rr, beta, "sigmoid", label_smoothing=eps).losses
    la = F.logsigmoid(torch.tensor([g, -g], dtype=F64))
    torch.testing.assert_close(fwd, exo)
    torch.testing.assert_close(bwd, sig + (la.exp() * la).sum())
    (grad,) = torch.autograd.grad(bwd.sum(), pc)
    torch.testing.assert_close(grad, torch.autograd.grad(sig.sum(), pc)[0])


def test_rewards_are_required_and_a_constant_of_the_step():
    with pytest.raises(ValueError, match="needs the pairs' reward_margins"):
        dpo_loss(PC, PR, RC, RR, 0.5, "rpo_sq")
    pc = PC.clone().requires_grad_()
    margins = G.clone().requires_grad_()
    dpo_loss(pc, PR, RC, RR, 0.5, "rpo_sq", reward_margins=margins).losses.sum().backward()
    assert margins.grad is None and pc.grad is not None


# ----------------------------------------------------------------------------- data path


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dataset(path, loss_type="rpo_sq", defaults=(None, None)):
    from e2e_cli import TOKENIZER

    from megatron_kto.data.collate import dpo_custom_collate
    from megatron_kto.data.dataset import build_dpo_dataset
    from megatron_kto.data.rewards import pair_rewards
    from megatron_kto.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer("sentencepiece", str(TOKENIZER))
    dataset, _ = build_dpo_dataset([path], tokenizer, 64, use_cache=False)
    dataset.rewards = pair_rewards(dataset, [path], defaults, loss_type)
    return dpo_custom_collate([dataset[i] for i in range(len(dataset))], pad_id=0)


PAIR = {"prompt": "Hi", "chosen": " there", "rejected": " go"}


def test_rows_rewards_reach_the_batch_and_defaults_fill_gaps(tmp_path):
    rows = [{**PAIR, "chosen_reward": 2.5, "rejected_reward": -1}, PAIR]
    batch = _dataset(_write(tmp_path / "d.jsonl", rows), defaults=(1.0, 0.0))
    assert batch["chosen_rewards"].tolist() == [2.5, 1.0]
    assert batch["rejected_rewards"].tolist() == [-1.0, 0.0]


def test_a_missing_reward_is_one_line_naming_the_row(tmp_path):
    rows = [{**PAIR, "chosen_reward": 1, "rejected_reward": 0}, {**PAIR, "chosen_reward": 1}]
    with pytest.raises(ConfigError) as e:
        _dataset(_write(tmp_path / "d.jsonl", rows))
    assert str(e.value).startswith(f"{tmp_path / 'd.jsonl'}:2: rejected_reward: missing")
    assert "model.data.default_rejected_reward" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("value,shown", [("high", "string 'high'"), (True, "True"), ([1], "[1]")])
def test_a_reward_of_the_wrong_type_is_one_line(tmp_path, value, shown):
    from megatron_kto.data.errors import DataFormatError

    rows = [PAIR, {**PAIR, "chosen_reward": value, "rejected_reward": 0}]
    with pytest.raises(DataFormatError) as e:
        _dataset(_write(tmp_path / "d.jsonl", rows))
    assert str(e.value) == (
        f"{tmp_path / 'd.jsonl'}:2: chosen_reward: expected a finite number, got {shown}"
    )
