"""Exporting a LoRA run's adapter reads the adapters, not the base model: measured.

One process builds a fp32 base (4 layers of hidden 512, a 16k vocabulary: ~100 MB of weights)
and writes it as a checkpoint, adds rank-4 adapters on every projection (random values, so
every tensor is non-trivial), and writes a LoRA training checkpoint as a run does (the adapter
tensors, its config.yaml, architecture.json and lora_base.json with the base's fingerprint).
Then `hf_writer.lora_export.export_adapter` runs inside a `planning.measure.AllocationTrace` window:

* the torch tensor bytes it allocates at its peak stay under a tenth of the base's fp32 weights
  (rebuilding the base, as the export used to, allocates all of them);
* the adapter file holds exactly the adapters the process built, bit for bit;
* with the base checkpoint deleted the export still works and writes the same bytes (it never
  reads the base).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from multirank import run_multirank

LAYERS, HIDDEN, FFN, VOCAB, RANK = 4, 512, 1536, 16384, 4
LORA = [
    "model.peft.peft_scheme=lora",
    f"model.peft.lora_tuning.adapter_dim={RANK}",
    "model.peft.lora_tuning.alpha=16",
    "model.peft.lora_tuning.target_modules=[q_proj,k_proj,v_proj,o_proj,mlp]",
]


def _write_lora_checkpoint(root: Path) -> tuple[dict[str, torch.Tensor], int]:
    """Base checkpoint `root/base`, LoRA checkpoint `root/lora`; returns (the adapters as PEFT
    keys -> tensors, the base's fp32 bytes)."""
    from omegaconf import OmegaConf

    from megatron_kto.checkpointing.model_io import (
        model_sharded_state_dict,
        save_model,
        save_sharded,
        write_architecture,
    )
    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.entry import compose_run_config
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.peft.checkpoint import (
        BASE_FILE,
        adapter_sharded_state_dict,
        base_fingerprint,
        base_record,
    )
    from megatron_kto.peft.hf_peft import full_tensors
    from megatron_kto.peft.settings import lora_settings
    from megatron_kto.peft.wiring import adapters_of, apply_lora
    from megatron_kto.runtime import init_runtime, teardown

    cfg = compose_run_config("gpt_kto", LORA, "kto", world_size=1).cfg
    rt = init_runtime(1, 1, seed=0)
    arch = GPTArchitecture(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, vocab_size=VOCAB
    )
    chunks = build_gpt_chunks(arch, ParallelLayout(), rt.device)
    base_bytes = sum(p.numel() * 4 for p in chunks[0].parameters())
    (root / "base").mkdir()
    save_model(root / "base", chunks, arch)
    apply_lora(chunks, arch, lora_settings(cfg.model))
    fingerprint = base_fingerprint(chunks)  # over the frozen parameters: the base's
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for adapter in adapters_of(chunks):
            for pair in adapter.adapters.values():
                for p in (pair.lora_A, pair.lora_B):
                    p.copy_(torch.randn(p.shape, generator=gen))
    lora = root / "lora"
    lora.mkdir()
    save_sharded(adapter_sharded_state_dict(model_sharded_state_dict(chunks)), lora)
    write_architecture(lora, arch)
    OmegaConf.save(cfg, lora / "config.yaml")
    record = base_record(str(root / "base"), fingerprint)
    (lora / BASE_FILE).write_text(json.dumps(record))
    adapters = {k: v.clone() for k, v in full_tensors(chunks).items()}
    teardown()
    return adapters, base_bytes


def _worker(rank: int, world_size: int, root: str) -> dict:
    from safetensors.torch import load_file

    from megatron_kto.hf_writer.lora_export import export_adapter
    from megatron_kto.planning.measure import AllocationTrace

    root = Path(root)
    adapters, base_bytes = _write_lora_checkpoint(root)
    with AllocationTrace() as trace, trace.window():
        export_adapter(root / "lora", root / "adapter")
    shutil.rmtree(root / "base")
    try:
        export_adapter(root / "lora", root / "adapter_no_base")
        no_base_error = None
    except Exception as e:  # reported by the test, after the memory numbers
        no_base_error = f"{type(e).__name__}: {e}"
    written = load_file(str(root / "adapter" / "adapter_model.safetensors"))
    return {
        "added": trace.peak - trace.at_start,
        "base_bytes": base_bytes,
        "adapter_bytes": sum(t.numel() * 4 for t in adapters.values()),
        "no_base_error": no_base_error,
        "same": written.keys() == adapters.keys()
        and all(torch.equal(written[k], adapters[k]) for k in adapters),
    }


def test_adapter_export_reads_the_adapters_only(tmp_path):
    r = run_multirank(_worker, 1, str(tmp_path), timeout=300)[0]
    print(f"\nadapter export: {r}")
    assert r["base_bytes"] > 80e6 and r["adapter_bytes"] < 2e6  # the sizes this test reasons with
    assert r["added"] < r["base_bytes"] / 10
    assert r["same"]
    assert r["no_base_error"] is None
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        a = (tmp_path / "adapter" / name).read_bytes()
        assert a == (tmp_path / "adapter_no_base" / name).read_bytes()
