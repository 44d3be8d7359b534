"""A mixture-of-experts model under context parallelism, router load-balancing loss off.

README's model table lists "CP (aux loss off)" for the MoE families: with CP each rank routes
only its part of every row, so the balance statistics would be partial; the run refuses
`context_parallel_size > 1` with the aux loss on (one `error:` line naming both keys) and trains
with `model.moe_aux_loss_coeff=0`. Shown here on a tiny random `transformers` Qwen3-MoE
(`hf_tiny.make_hf_qwen3_moe`: 2 layers, 4 experts, top-2, decisive routers; its config's
`router_aux_loss_coef` is 0.01, turned off by the override), trained from its Hugging Face
directory by `examples/train_gpt_kto.py` for 3 fp32 steps on one process (CP=1) and on two with
`model.context_parallel_size=2` (DP=1 both: the same micro-batches): every step's metrics and the
written `hf/` weights of the CP=2 run equal CP=1's to a relative 1e-4 (as `test_e2e_context_
parallel.py` for a dense model; near-zero rewards to fp32 round-off), and no aux loss is logged.
"""

from __future__ import annotations

import pytest
from e2e_cli import KTO_SCRIPT, QUIET, launch, read_metrics, run_script
from hf_tiny import make_hf_qwen3_moe, write_kto_rows
from test_e2e_layouts import METRICS, RTOL, _metric_rel_diff

pytestmark = pytest.mark.e2e

STEPS = 3
CP2 = "model.context_parallel_size=2"
AUX_OFF = "model.moe_aux_loss_coeff=0"
#: Rewards and kl are β x differences of summed log-probs (~60, fp32 ulp ~4e-6), so near zero
#: (step 2) they get an absolute tolerance of that size besides RTOL (as in test_e2e_moe.py).
METRIC_ATOL = 5e-6


def _args(root, name: str) -> list[str]:
    return [
        *QUIET,
        f"pretrained_checkpoint.restore_from_path={root / 'hf'}",
        f"model.data.data_prefix.train=[{root / 'train.jsonl'}]",
        "model.data.data_prefix.validation=[]",
        "trainer.precision=32",
        f"exp_manager.explicit_log_dir={root / name}",
        f"trainer.kto.max_steps={STEPS}",
        f"trainer.kto.save_interval={STEPS}",
        "model.global_batch_size=8",
        "model.micro_batch_size=2",
        "model.data.shuffle=false",
        "model.data.max_length=64",
        # A full-size first step (no warm-up from lr 0), so every step moves the weights.
        "model.optim.sched.name=Constant",
        "model.optim.sched.warmup_steps=0",
        "model.optim.lr=1e-3",
        "exp_manager.save_hf=true",
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_cp")
    make_hf_qwen3_moe(root / "hf", router_aux_loss_coef=0.01)
    write_kto_rows(root / "train.jsonl", 0, 64)
    run_script(KTO_SCRIPT, [*_args(root, "cp1"), AUX_OFF])
    run_script(KTO_SCRIPT, [*_args(root, "cp2"), AUX_OFF, CP2], nproc=2, timeout=600)
    return root


def test_moe_at_cp2_with_the_aux_loss_off_equals_cp1(runs):
    from safetensors.torch import load_file

    want, got = read_metrics(runs / "cp1"), read_metrics(runs / "cp2")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    assert all(r["kl"] > 0 for r in want[1:]), "z0 > 0 should be exercised"
    for ref_row, row in zip(want, got, strict=True):
        assert not row.get("aux_loss") and not ref_row.get("aux_loss")
        for key in METRICS:
            if key in ref_row:
                close = abs(row[key] - ref_row[key]) <= METRIC_ATOL
                assert close or _metric_rel_diff(row[key], ref_row[key]) <= RTOL, (row["step"], key)
    start, cp1, cp2 = (
        {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}
        for d in (runs / "hf", runs / "cp1" / "hf", runs / "cp2" / "hf")
    )
    assert cp1.keys() == cp2.keys()
    assert any("experts" in k for k in cp1)
    moved = max(float((cp1[k] - start[k]).abs().max()) for k in cp1)
    worst = max(float((cp2[k] - cp1[k]).abs().max() / cp1[k].abs().max()) for k in cp1)
    assert moved > 1e-4 and worst <= RTOL, (moved, worst)


def test_moe_at_cp2_with_the_aux_loss_on_is_one_error_line(runs):
    """Refused before any model is built: rank 0 prints one `error:` line, exit code 2 (torchrun
    then reports the failed rank and exits 1)."""
    proc, _ = launch([str(KTO_SCRIPT), *_args(runs, "refused"), CP2], nproc=2, timeout=300)
    assert proc.returncode != 0
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
    assert errors == [
        "error: model.moe_aux_loss_coeff: 0.01: the router load-balancing loss is not supported "
        "with model.context_parallel_size=2 (each rank routes part of every row); set "
        "model.moe_aux_loss_coeff=0 or model.context_parallel_size=1"
    ], errors
    assert not (runs / "refused" / "metrics.jsonl").exists()
