"""A training run whose Hugging Face output cannot be written stops with one `error:` line.

`examples/train_gpt_kto.py` (the bundled tiny example) runs at TP=2 under torchrun for one step
with `exp_manager.save_hf=true` and small shards, over a run directory that already has an
`hf/` (a previous export, as left by an earlier run). On rank 0 — the writer of the only
pipeline stage — every safetensors write runs under a 1 KiB file-size limit (a
`sitecustomize` on the ranks' PYTHONPATH, test-only), so the first shard fails with the
kernel's "File too large" while rank 1 still has most tensors to gather with it: a full disk.

Checked: exit code 2 (torchrun's report), exactly one line on rank 0's stderr — the
`error:` line naming `hf.tmp`, the failing rank and the cause — nothing on rank 1's, no
traceback; the run ends within seconds of its checkpoint (before the fix it hung in the
gather until the 30-minute collective timeout); the checkpoint is complete, `hf/` is the
previous one and no `hf.tmp/` is left.
"""

from __future__ import annotations

import os
import time

import pytest
from e2e_cli import KTO_SCRIPT, QUIET, TINY_EXAMPLE, launch

pytestmark = pytest.mark.e2e

CAUSE = "SafetensorError: Error while serializing: I/O error: File too large (os error 27)"
#: Seconds from the checkpoint to the last rank's exit (rank 1 waits QUIET_RANK_GRACE_S = 10 s).
BOUND_S = 45.0
INJECT = '''"""Test-only: on rank $FAIL_HF_WRITE_RANK, safetensors writes run under a 1 KiB file-size
limit, so they fail as on a full disk."""
import os

if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get(
    "FAIL_HF_WRITE_RANK"
):
    import resource

    import safetensors.torch

    _save_file = safetensors.torch.save_file

    def _limited(*args, **kwargs):
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))
        try:
            return _save_file(*args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)

    safetensors.torch.save_file = _limited
'''


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_output_failure")
    inject = root / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT)
    run = root / "run"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "model.safetensors").write_bytes(b"the previous export")
    args = [
        str(KTO_SCRIPT),
        *QUIET,
        TINY_EXAMPLE,
        f"exp_manager.explicit_log_dir={run}",
        "model.tensor_model_parallel_size=2",
        "trainer.kto.max_steps=1",
        "exp_manager.save_hf=true",
        "exp_manager.save_hf_max_shard_mb=0.01",
    ]
    path = os.environ.get("PYTHONPATH", "")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", f"{inject}{os.pathsep}{path}" if path else str(inject))
        env.setenv("FAIL_HF_WRITE_RANK", "0")
        proc, ranks = launch(args, 2, timeout=240, logs=root / "torchrun")
    return run, proc, ranks, time.time()


def test_every_rank_stops_with_one_error_line(failed_run):
    run, proc, ranks, ended = failed_run
    assert len(ranks) == 2
    (_, err0), (_, err1) = ranks
    want = f"error: {run / 'hf.tmp'}: writing the Hugging Face output failed on rank 0: {CAUSE}"
    assert err0.strip().splitlines() == [want], err0[-3000:]
    assert not err1.strip(), err1[-3000:]
    assert all("Traceback" not in out + err for out, err in ranks)
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-2000:]
    checkpoint = run / "checkpoints" / "step_1"
    assert (checkpoint / "metadata.json").is_file()
    assert (run / "checkpoints" / "latest").read_text().strip().endswith("step_1")
    took = ended - (checkpoint / "metadata.json").stat().st_mtime
    print(f"\nexited {took:.1f} s after the checkpoint was written")
    assert took < BOUND_S
    assert [p.name for p in (run / "hf").iterdir()] == ["model.safetensors"]
    assert (run / "hf" / "model.safetensors").read_bytes() == b"the previous export"
    assert not (run / "hf.tmp").exists()
