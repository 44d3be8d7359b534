"""`model.kto.loss_type=apo_zero_unpaired` through the CLI: no KL rows anywhere, `kl` reads 0.

One short run of `examples/train_gpt_kto.py` as a user launches it (training and a validation
pass). The data pipeline then collates no KL rows, the trainer attaches no KL reference log-probs
and counts only the sample rows' tokens; `tests/test_kto_no_kl_rows.py` counts the rows that
enter the models and compares the step with the KL-computing path.
"""

from __future__ import annotations

import math

import pytest
from e2e_cli import KTO_SCRIPT, QUIET, read_metrics, run_script

pytestmark = pytest.mark.e2e


def test_apo_zero_unpaired_run_reports_kl_zero(tmp_path):
    log_dir = tmp_path / "run"
    args = [
        *QUIET,
        f"exp_manager.explicit_log_dir={log_dir}",
        "exp_manager.create_checkpoint_callback=false",
        "trainer.kto.max_steps=3",
        "trainer.kto.val_check_interval=3",
        "trainer.kto.limit_val_batches=1",
        "model.kto.loss_type=apo_zero_unpaired",
        "model.micro_batch_size=1",
        "model.global_batch_size=4",
    ]
    run_script(KTO_SCRIPT, args)
    train, val = read_metrics(log_dir, "train"), read_metrics(log_dir, "val")
    assert [r["step"] for r in train] == [1, 2, 3] and len(val) == 1
    for row in train + val:
        assert row["kl"] == 0.0, row
        assert math.isfinite(row["loss"]) and row["loss"] > 0, row
    for row in train:
        assert row["tokens_per_sec"] > 0 and row["mfu"] > 0, row
    # (The first validation batch of the bundled set is all desirable: rewards/chosen is the
    # class it has, and margins are 0 without both classes.)
    assert val[0]["rewards/chosen"] != 0, "the policy moved away from the reference"
