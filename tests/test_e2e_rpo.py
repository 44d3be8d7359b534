"""A NeMo-Aligner-style DPO config with `model.dpo.preference_loss: rpo_sq` trains (e2e).

The config file is NeMo's shape (its keys and names: `preference_loss`, `gt_reward_scale`,
`model.data.default_*_reward`, Lightning plumbing), given with `--config-path/--config-name` as a
user would. The data carry `chosen_reward` / `rejected_reward` on every row but one, which takes
the defaults; every pair's reward gap is 2 (so g = gt_reward_scale × 2 = 1). At step 1 the policy
is the reference (h = 0), so the loss is exactly the mean of (0 − g)² = 1; step 2 has moved.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from e2e_cli import REPO, TOKENIZER, cli_env, read_metrics, save_initial_checkpoint

pytestmark = pytest.mark.e2e

DPO_SCRIPT = REPO / "examples" / "train_gpt_dpo.py"
DPO_DATA = REPO / "examples" / "data" / "tiny_dpo" / "train.jsonl"

NEMO_STYLE = """\
trainer:
  num_nodes: 1
  devices: 1
  accelerator: gpu
  precision: 32
  logger: false
  dpo:
    max_epochs: 1
    max_steps: 2
    val_check_interval: 10
    save_interval: 0
    limit_val_batches: 0
    gradient_clip_val: 1.0
model:
  mcore_gpt: true
  micro_batch_size: 2
  global_batch_size: 4
  dpo:
    ref_policy_kl_penalty: 0.1
    preference_loss: rpo_sq
    gt_reward_scale: 0.5
  data:
    data_prefix: null
    default_chosen_reward: 3.0
    default_rejected_reward: 1.0
  optim:
    lr: 1.0e-3
exp_manager:
  explicit_log_dir: null
  create_checkpoint_callback: false
  create_tensorboard_logger: false
pretrained_checkpoint:
  restore_from_path: null
"""


def test_nemo_style_rpo_sq_config_trains(tmp_path):
    rows = [json.loads(line) for line in DPO_DATA.read_text().splitlines()[:8]]
    for k, row in enumerate(rows[1:], start=1):  # row 0 takes the defaults (3, 1)
        row.update(chosen_reward=0.25 * k + 2, rejected_reward=0.25 * k)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "gpt_dpo_rpo.yaml").write_text(NEMO_STYLE)
    init = save_initial_checkpoint(tmp_path / "init", seed=5)
    log_dir = tmp_path / "run"
    args = [
        "--config-path", str(tmp_path / "conf"), "--config-name", "gpt_dpo_rpo",
        "+trainer.peak_flops_per_device=1e12",
        f"pretrained_checkpoint.restore_from_path={init}",
        f"model.data.data_prefix={{train:[{data}],validation:[]}}",
        "+model.tokenizer.library=sentencepiece",
        f"+model.tokenizer.model={TOKENIZER}",
        f"exp_manager.explicit_log_dir={log_dir}",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(DPO_SCRIPT), *args],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    train = read_metrics(log_dir)
    print(f"\nrpo_sq losses {[r['loss'] for r in train]}")
    assert [r["step"] for r in train] == [1, 2]
    assert train[0]["loss"] == pytest.approx(1.0, abs=1e-6)  # mean (β·0 − 1)²
    assert train[1]["loss"] != pytest.approx(1.0, abs=1e-6)  # it trained
