"""tools/gpu_acceptance.sh on a machine without CUDA, as CI runs it.

Without `--cpu` every check is `SKIP no CUDA` and the script exits 0; with `--cpu` a subset runs
for real on the CPU (the quick start and a resume of it, the MoE check, and the MoE model at
PP=2 over two gloo ranks under torchrun), so the script's own logic — launching, reading
metrics.jsonl, the resume verdict, the summary — is exercised. The verdict functions are also
given hand-made metrics that must FAIL, a failing command must turn into a FAIL line and exit
code 1, a check that overruns its time budget is stopped and FAILs, and on one GPU the 2-GPU
checks SKIP with their reason.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu_acceptance.sh"
sys.path.insert(0, str(REPO / "tools"))
import acceptance_checks as ac  # noqa: E402

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _lines(stdout: str) -> dict[str, str]:
    """check name -> its status line."""
    return {
        m[2]: m[0] for m in re.finditer(r"^(PASS|FAIL|SKIP) (\w+).*$", stdout, flags=re.MULTILINE)
    }


@cpu_only
def test_without_cuda_every_check_skips_and_the_script_exits_0(tmp_path) -> None:
    proc = _run("--work", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = _lines(proc.stdout)
    assert set(lines) == set(ac.CHECKS)
    for name, line in lines.items():
        assert line.startswith(f"SKIP {name}: no CUDA"), line
    assert f"summary: 0 PASS, 0 FAIL, {len(ac.CHECKS)} SKIP" in proc.stdout


@cpu_only
@pytest.mark.e2e
def test_cpu_mode_runs_the_quick_start_resumes_it_and_the_moe_check(tmp_path) -> None:
    # One of the 2-rank checks (over gloo under torchrun), to keep this test short: the quick
    # start, resume and MoE checks ~27 s here, moe_pp ~18 s more (lora would add ~10 s).
    checks = "quickstart,attention_te,resume,moe,moe_pp"
    proc = _run("--cpu", "--checks", checks, "--work", str(tmp_path), timeout=480)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = _lines(proc.stdout)
    assert lines["quickstart"].startswith("PASS quickstart"), proc.stdout
    # The figures come from the run's metrics.jsonl; no peak is known on a CPU.
    assert re.search(r"tokens/s [\d,]+, MFU - \(no known peak\), peak memory", lines["quickstart"])
    assert lines["attention_te"] == "SKIP attention_te: TE needs CUDA"
    assert lines["resume"].startswith("PASS resume") and "resumed at step 2" in lines["resume"]
    # A tiny Qwen3-MoE from its HF directory: hf/ reloads in transformers with our log-probs.
    assert lines["moe"].startswith("PASS moe") and "EP=1, local experts" in lines["moe"]
    # The same MoE model at PP=2 on two gloo ranks, the aux loss on.
    assert lines["moe_pp"].startswith("PASS moe_pp") and "PP=2, local experts" in lines["moe_pp"]
    assert re.search(r"^summary: 4 PASS, 0 FAIL, 1 SKIP in \d+ s$", proc.stdout, re.M)
    steps = [r["step"] for r in ac.read_metrics(tmp_path / "quickstart")]
    assert steps == [1, 2, 3, 4]


def _rows(steps: list[int], per_step: int = 16, loss: float = 0.7) -> list[dict]:
    return [{"step": s, "consumed_samples": s * per_step, "loss": loss} for s in steps]


def test_resume_verdict_passes_a_continued_run() -> None:
    ac.check_resumed("resumed from step 2 (32 samples)", _rows([1, 2, 3, 4]), 2, 4)


@pytest.mark.parametrize(
    ("output", "rows", "reason"),
    [
        ("fresh start", _rows([1, 2, 3, 4]), "did not report"),
        ("resumed from step 2", _rows([1, 2, 3]), "not 4"),
        ("resumed from step 2", _rows([1, 2, 1, 2, 3, 4]), "out of order or twice"),
        (
            "resumed from step 2",
            _rows([1, 2])
            + [
                {"step": s, "consumed_samples": (s - 2) * 16, "loss": 0.7} for s in (3, 4)
            ],  # fmt: skip
            "restarted",
        ),
        ("resumed from step 2", _rows([1, 2, 3, 4], loss=float("nan")), "non-finite"),
    ],
)
def test_resume_verdict_fails_what_is_not_a_resume(output, rows, reason) -> None:
    with pytest.raises(ac.CheckFailed, match=reason):
        ac.check_resumed(output, rows, 2, 4)


def test_figures_leave_out_the_first_step_and_take_the_highest_memory() -> None:
    rows = [
        {"tokens_per_sec": 1.0, "mfu": 0.01, "peak_memory_gb": 2.0},
        {"tokens_per_sec": 100.0, "mfu": 0.30, "peak_memory_gb": 1.0},
        {"tokens_per_sec": 300.0, "mfu": 0.50, "peak_memory_gb": 1.5},
    ]
    assert ac.figures(rows) == {"tokens_per_sec": 200.0, "mfu": 0.40, "peak_memory_gb": 2.0}
    assert ac.format_figures(ac.figures(rows)) == ("tokens/s 200, MFU 40.0%, peak memory 2.00 GiB")


def test_a_failing_command_is_a_fail_line_and_exit_code_1(tmp_path, capsys, monkeypatch) -> None:
    ctx = ac.Context(tmp_path, cuda=False, gpus=0, transformer_engine=False, steps=2, timeout=60)

    def broken(ctx: ac.Context) -> str:
        ac.launch(ctx, "broken", ["-c", "import sys; print('error: boom'); sys.exit(3)"])
        return "unreachable"

    monkeypatch.setitem(ac.CHECKS, "broken", broken)
    results = ac.run_checks(ctx, ["broken", "te_local_checkpoint"], gpu_required=False)
    assert ac.summary_exit_code(results) == 1
    out = capsys.readouterr().out
    assert re.search(r"^FAIL broken \(\d+ s\): exit 3: error: boom \(.*broken\.log\)$", out, re.M)
    assert "SKIP te_local_checkpoint: needs Transformer Engine on CUDA" in out
    assert "summary: 0 PASS, 1 FAIL, 1 SKIP" in out
    assert (tmp_path / "broken.log").read_text() == "error: boom\n"


def test_on_one_gpu_the_two_gpu_checks_skip_with_their_reason(tmp_path, capsys) -> None:
    ctx = ac.Context(tmp_path, cuda=True, gpus=1, transformer_engine=False, steps=2, timeout=60)
    names = ["moe_pp", "context_parallel", "pipeline", "restart"]
    results = ac.run_checks(ctx, names, gpu_required=False)
    assert [status for _, status, _ in results] == ["SKIP"] * 4
    out = capsys.readouterr().out
    assert "SKIP moe_pp: PP=2 needs 2 GPUs; this machine has 1" in out
    assert "SKIP context_parallel: CP=2 needs 2 GPUs; this machine has 1" in out
    assert "SKIP restart: a restart of 2 ranks needs 2 GPUs; this machine has 1" in out
    assert not list(tmp_path.iterdir()), "a skipped check launched something"


def test_a_check_over_its_budget_is_stopped_and_fails(tmp_path, capsys, monkeypatch) -> None:
    ctx = ac.Context(tmp_path, cuda=False, gpus=0, transformer_engine=False, steps=2, timeout=60)

    def slow(ctx: ac.Context) -> str:
        ac.launch(ctx, "slow", ["-c", "import time; time.sleep(30)"])
        return "unreachable"

    monkeypatch.setitem(ac.CHECKS, "slow", slow)
    monkeypatch.setitem(ac.BUDGETS, "slow", 2.0)
    results = ac.run_checks(ctx, ["slow"], gpu_required=False, budget_scale=1.0)
    assert results[0][1] == "FAIL"
    out = capsys.readouterr().out
    assert re.search(r"^FAIL slow \(\d s of 2 s\): -c: ran over the check's budget", out, re.M)


def test_the_one_gpu_budgets_fit_one_ten_minute_call() -> None:
    """The header's promise: the checks that run on one GPU without TE (a lent machine) fit one
    10-minute call with time to install; every check has a budget."""
    assert set(ac.BUDGETS) == set(ac.CHECKS)
    elsewhere = {
        "moe_pp",
        "context_parallel",
        "pipeline",
        "restart",
        "attention_te",
        "te_local_checkpoint",
    }
    assert sum(v for k, v in ac.BUDGETS.items() if k not in elsewhere) <= 555


@pytest.mark.parametrize(
    ("bf16", "verdict"), [(0.2681, "PASS"), (17.26, "FAIL")], ids=["measured_fix", "cudnn"]
)
def test_the_sdpa_check_compares_bf16_gradients_with_fp32(
    tmp_path, capsys, monkeypatch, bf16, verdict
):
    """The SDPA check's bf16 step-1 gradient norm against the fp32 quick start's (H200 figures:
    0.2681 with cuDNN attention excluded, 17.26 with it, fp32 0.2684)."""
    ctx = ac.Context(tmp_path, cuda=True, gpus=1, transformer_engine=False, steps=2, timeout=60)
    for name, norm in (("quickstart", 0.2684), ("attention_sdpa", bf16)):
        (tmp_path / name).mkdir()
        row = {"split": "train", "step": 1, "grad_norm": norm}
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    ctx.runs["quickstart"] = tmp_path / "quickstart"

    def trained(ctx, name, overrides, nproc=1, saves=1):
        assert "trainer.precision=bf16" in overrides
        ctx.runs[name] = tmp_path / name
        return "figures"

    monkeypatch.setattr(ac, "train", trained)
    results = ac.run_checks(ctx, ["attention_sdpa"], gpu_required=False)
    assert results[0][1] == verdict
    if verdict == "FAIL":
        assert "step-1 gradient norm 17.26 vs the fp32 quick start's 0.2684" in results[0][2]
