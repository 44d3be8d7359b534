"""A write that fails during the Hugging Face output ends the export on every rank at once.

Two gloo ranks export a tiny model (`conversion.hf_output.HFOutput.write`, as a run's
`exp_manager.save_hf` does) first successfully (step 1: the previous `hf/`), then (step 2)
with the writing rank's file-size limit (`RLIMIT_FSIZE`) at 1 KiB: its safetensors writes fail
for real, with the kernel's "File too large", as on a full disk. Shards are small (4 KiB), so
the first write fails while the stage still has most of its tensors to gather. Layouts:

* TP=2: the writer (rank 0) fails; rank 1 is still gathering tensors with it;
* LoRA at TP=2 with `hf_merged/`: the writer fails on the adapter file; the merged weights'
  gathers follow;
* PP=2: stage 1's writer (rank 1) fails; rank 0 must still name the cause.

Every rank raises the same one-line `CheckpointError` (the `.tmp` directory, the failing rank,
the cause) within seconds — before the fix the writer stopped gathering and the job hung until
the collective timeout; `hf/` keeps step 1's files and no `hf.tmp/` is left.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest
from multirank import run_multirank

CAUSE = "SafetensorError: Error while serializing: I/O error: File too large (os error 27)"
#: (layout name, TP, PP, LoRA, the failing writer's rank)
CASES = [("tp2", 2, 1, False, 0), ("lora_tp2", 2, 1, True, 0), ("pp2", 1, 2, False, 1)]
#: Seconds a failed export may take on a rank (a hang is the collective timeout: minutes).
BOUND_S = 15.0


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _export_twice(rank: int, root: Path, tp: int, pp: int, lora: bool, failing: int) -> dict:
    from megatron_kto.checkpointing.errors import CheckpointError
    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.hf_writer.output import HFOutput
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.peft.wiring import LoRASettings, apply_lora
    from megatron_kto.runtime import init_runtime

    # The process group stays; megatron's groups are made anew for this layout.
    rt = init_runtime(tp, pp, seed=0, timeout_minutes=2)
    arch = GPTArchitecture(num_layers=2, hidden_size=64, ffn_hidden_size=128, vocab_size=256)
    layout = ParallelLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    chunks = build_gpt_chunks(arch, layout, rt.device)
    settings = LoRASettings(rank=4, alpha=8.0, init_b="xavier") if lora else None
    if settings is not None:
        apply_lora(chunks, arch, settings)
    output = HFOutput(
        arch,
        root,
        restore_from_path=None,
        tokenizer_model=None,
        lora=settings,
        merged=lora,
        max_shard_bytes=4096,
        dtype="float32",
    )
    output.write(1, chunks, None)
    before = _files(root / "hf") if rank == 0 else {}
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == failing:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))
    start = time.monotonic()
    try:
        output.write(2, chunks, None)
        error = None
    except CheckpointError as e:
        error = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    seconds = time.monotonic() - start
    return {"error": error, "seconds": seconds, "before": before}


def _worker(rank: int, world_size: int, root: str) -> dict[str, dict]:
    from megatron_kto.runtime import teardown

    out = {}
    for name, tp, pp, lora, failing in CASES:
        (Path(root) / name).mkdir(exist_ok=True)
        out[name] = _export_twice(rank, Path(root) / name, tp, pp, lora, failing)
    teardown()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_failure")
    return root, run_multirank(_worker, 2, str(root), timeout=240)


@pytest.mark.parametrize("name,failing", [(c[0], c[4]) for c in CASES])
def test_a_failed_write_ends_the_export_on_every_rank_with_one_line(results, name, failing):
    root, per_rank = results
    tmp = root / name / "hf.tmp"
    want = f"{tmp}: writing the Hugging Face output failed on rank {failing}: {CAUSE}"
    for rank, r in enumerate(per_rank):
        got = r[name]
        print(f"\n{name} rank {rank}: {got['seconds']:.2f} s: {got['error']}")
        assert got["error"] == want
        assert got["seconds"] < BOUND_S
    assert not tmp.exists()
    assert _files(root / name / "hf") == per_rank[0][name]["before"]  # step 1's, untouched
    if name.startswith("lora"):
        assert not (root / name / "hf_merged.tmp").exists()
