"""The pieces of the full-disk line, without a run: which errors mean "no space", the sizes,
the line itself, and the metrics logger keeping (not raising) a failed write.

The end-to-end behaviour (every rank stops, nothing saved is lost) is `test_e2e_disk_full.py`.
"""

from __future__ import annotations

import errno
import os

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from megatron_kto.checkpointing import files
from megatron_kto.checkpointing.disk_space import write_failure_line
from megatron_kto.logging.metrics_logger import MetricsLogger
from megatron_kto.runtime.disk import NO_SPACE, free_bytes, no_space_cause, size
from megatron_kto.runtime.peers import (
    is_peer_failure,
    is_timeout,
    lost_peer_line,
    reporting_rank,
    stuck_line,
)

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_is_found_wherever_it_is_wrapped(tmp_path):
    # What megatron-core raises on the saving rank: torch's zip writer's own words on one
    # worker, the kernel's ENOSPC on another, gathered per rank.
    zip_error = RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    )
    gathered = CheckpointException("write", {0: (zip_error, None), 1: (ENOSPC, None)})
    assert no_space_cause(gathered) == "no space left on device"
    assert no_space_cause(OSError(errno.EDQUOT, "quota")) == "disk quota exceeded"
    try:
        try:
            raise ENOSPC
        except OSError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as wrapped:
        assert no_space_cause(wrapped) == NO_SPACE
    assert no_space_cause(zip_error) is None
    assert no_space_cause(OSError(errno.EACCES, "Permission denied")) is None
    # numpy's short write names no errno: the free space decides.
    short = OSError("18383 requested and 992 written")
    assert no_space_cause(short, tmp_path, needed=1 << 60) == NO_SPACE
    assert no_space_cause(short, tmp_path, needed=1) is None
    # An errno that is not "no space" is never overruled by the free space.
    assert no_space_cause(OSError(errno.EACCES, "denied"), tmp_path, needed=1 << 60) is None


def test_sizes_and_the_line(tmp_path):
    assert [size(n) for n in (0, 1023, 1024, 1782579, 3 << 30)] == [
        "0 B", "1023 B", "1.0 KiB", "1.7 MiB", "3.0 GiB",
    ]  # fmt: skip
    root = tmp_path / "checkpoints"
    root.mkdir()
    tmp = root / "step_6.tmp"
    assert write_failure_line(tmp, "the checkpoint of step 6", NO_SPACE, root, 1782579, 0) == (
        f"{tmp}: no space left on device writing the checkpoint of step 6 (needs ~1.7 MiB, "
        "0 B free); no checkpoint was saved before it; free space and rerun the same command"
    )
    files.write_latest(root, "step_3")
    assert write_failure_line(tmp, "the checkpoint of step 6", "OSError: boom", root) == (
        f"{tmp}: writing the checkpoint of step 6 failed: OSError: boom; the last good "
        f"checkpoint, {root / 'step_3'}, is untouched and a rerun resumes from it"
    )


def test_the_metrics_logger_keeps_a_failed_write(tmp_path, monkeypatch):
    logger = MetricsLogger(tmp_path, rank0=True, tensorboard=False)
    logger.log("train", 1, 16, {"loss": 0.5})

    class Full:
        def write(self, text):
            return len(text)

        def flush(self):
            raise ENOSPC

        def close(self):
            raise ENOSPC

    monkeypatch.setattr(logger, "_file", Full())
    logger.log("train", 2, 32, {"loss": 0.4})  # does not raise: every rank must hear of it
    assert logger.failure is not None
    path, error = logger.failure
    assert path == tmp_path / "metrics.jsonl" and error is ENOSPC
    logger.log("train", 3, 48, {"loss": 0.3})  # nothing more is written
    logger.close()  # closing retries the failed write: already reported, not raised again
    assert [line[:30] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        '{"split": "train", "step": 1, '
    ]


@pytest.mark.parametrize(
    ("dead", "line", "reporter"),
    [
        ([1], "rank 1 of 4 died (killed or crashed: its own log says why)", 0),
        ([0, 2], "ranks 0, 2 of 4 died (killed or crashed)", 1),
        (None, "rank 0 (which held the job's rendezvous store) is gone", 1),
        ([], "a rank on another host is gone (its host's log says which and why)", 0),
    ],
)
def test_the_dead_rank_line_and_who_says_it(dead, line, reporter):
    assert lost_peer_line(dead, 4) == f"{line}; the other ranks stopped"
    assert reporting_rank(dead, 4) == reporter


#: gloo's words, as tests/test_distributed_timeout.py provokes them; NCCL's watchdog's, as
#: torch's ProcessGroupNCCL.cpp writes them.
GLOO_TIMEOUT = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "6000ms for recv operation to complete"
)
NCCL_TIMEOUT = (
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE,"
    " NumelIn=1, NumelOut=1, Timeout(ms)=6000) ran for 6002 milliseconds before timing out."
)


@pytest.mark.parametrize("words", [GLOO_TIMEOUT, NCCL_TIMEOUT])
def test_a_collective_timeout_is_a_peer_failure(words):
    import torch.distributed as dist

    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = dist.DistBackendError(words)
    assert is_timeout(wrapped) and is_peer_failure(wrapped)
    assert not is_timeout(RuntimeError("Connection reset by peer"))


@pytest.mark.parametrize(
    "stuck, steps, line, reporter",
    [
        ([1], {0: 7, 1: 7}, "rank 1 of 4 stopped answering at step 7 (its process is", 0),
        ([0, 2], {1: 3, 0: 2, 2: 3}, "ranks 0, 2 of 4 stopped answering at steps 2, 3 (their", 1),
        ([3], {0: 1}, "rank 3 of 4 stopped answering before its first step (its process", 0),
        ([], {}, "every rank timed out waiting for the others after", 0),
    ],
)
def test_the_stuck_rank_line_and_who_says_it(stuck, steps, line, reporter):
    said = stuck_line(stuck, steps, 4, 0.5)
    assert said.startswith(line), said
    assert "trainer.distributed_timeout_minutes=0.5" in said
    assert reporting_rank(stuck, 4) == reporter


def test_a_tensorboard_write_that_fails_is_kept_too(tmp_path):
    """TensorBoard writes its events from a thread and re-raises that thread's error on a later
    call; whichever call raises, the logger keeps it (with the TensorBoard directory)."""
    logger = MetricsLogger(tmp_path, rank0=True, tensorboard=True)
    logger.log("train", 1, 16, {"loss": 0.5})

    class FullWriter:
        def add_scalar(self, *args, **kwargs):
            raise ENOSPC

        def close(self):
            raise ENOSPC

    logger._tb_writer = FullWriter()
    logger.log("train", 2, 32, {"loss": 0.4})
    assert logger.failure == (tmp_path / "tensorboard", ENOSPC)
    logger.close()
    # metrics.jsonl got step 2 (written before TensorBoard), then nothing more.
    steps = [line[:30] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == ['{"split": "train", "step": 1, ', '{"split": "train", "step": 2, ']


def test_the_hugging_face_output_line_for_a_full_disk(tmp_path):
    from types import SimpleNamespace

    from megatron_kto.hf_writer.output import HFOutput

    tmp, ckpt = tmp_path / "hf.tmp", tmp_path / "checkpoints" / "step_9"
    writer = SimpleNamespace(_rank=1)
    free = size(free_bytes(tmp_path))
    assert HFOutput._failure_line(writer, ENOSPC, tmp, ckpt) == (
        f"{tmp}: no space left on device writing the Hugging Face output on rank 1 ({free} "
        f"free); the checkpoint {ckpt} is complete and a rerun of the same command writes the "
        "output from it; free space and rerun the same command"
    )
    # Other causes keep their own words (tests/test_hf_output_failure.py: "File too large").
    assert HFOutput._failure_line(writer, OSError(errno.EFBIG, "File too large"), tmp, ckpt) == (
        f"{tmp}: writing the Hugging Face output failed on rank 1: OSError: [Errno 27] File too "
        "large"
    )
