"""LoRA on Transformer Engine linears, run on CPU through megatron-core's TE wrappers over TE
stand-ins (`te_standin`): the same adapter, checkpoint and numbers as on the local spec.

One base (the tiny GPT, built with the local spec, saved, loaded into a TE-spec model — whose
QKV and fc1 linears are `TELayerNormColumnParallelLinear`, the norms fused into them) gets
adapters on every projection (rank 4, B non-zero so they contribute) under both specs. Shown:

* the adapter state holds (A, B) only, with the same keys under both specs — no base tensor
  (the fused norm's weight) under `lora.*` — so adapters-only checkpoints are interchangeable;
* an adapter on a fused-norm linear reads TE's own normalised input (`return_layernorm_output`):
  the very tensor the base returned, no recomputed norm; its term equals scaling·B·A of it;
* loss and adapter gradients equal the local spec's, at TP=1 and at TP=2 with sequence
  parallelism (where TE returns this rank's sequence chunk of the norm output);
* an adapters-only checkpoint of the local-spec run resumes in the TE-spec model and back, with
  the same base fingerprint on both sides.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from multirank import run_multirank

pytestmark = pytest.mark.multirank

RTOL = 1e-5


def _lora(chunks, arch) -> None:
    from megatron_kto.peft.wiring import LoRASettings, apply_lora

    settings = LoRASettings(
        rank=4, alpha=8, target_modules=["all"], init_a="kaiming", init_b="normal", seed=3
    )
    apply_lora(chunks, arch, settings)


def _forward_backward(chunks) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token losses of one batch and the adapters' gradients (this rank's shards)."""
    from test_checkpoint_harness import make_batch

    from megatron_kto.models.builder import unwrap

    model = unwrap(chunks[0])
    batch = make_batch(0)
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    losses.float().mean().backward()
    grads = {
        k: p.grad.detach().clone() for k, p in model.lora.named_parameters() if p.requires_grad
    }
    for p in model.lora.parameters():
        p.grad = None
    return losses.detach().clone(), grads


def _worker(rank: int, world_size: int, tmp: str, sequence_parallel: bool) -> dict:
    from te_standin import te_spec_models
    from test_checkpoint_harness import make_batch, tiny_arch
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_kto.checkpointing.model_io import (
        load_model,
        model_sharded_state_dict,
        save_model,
        save_sharded,
    )
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
    from megatron_kto.peft.checkpoint import (
        BASE_FILE,
        adapter_sharded_state_dict,
        base_fingerprint,
        base_record,
        check_same_base,
        load_adapters,
    )
    from megatron_kto.peft.lora import fuses_norm
    from megatron_kto.peft.wiring import adapters_disabled
    from megatron_kto.runtime import init_runtime, teardown

    root = Path(tmp)
    for name in ("base", "local_to_te", "te_to_local"):
        (root / name).mkdir(exist_ok=True)
    tp = world_size
    runtime = init_runtime(tp, 1, seed=1)
    arch = tiny_arch()
    layout = ParallelLayout(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)
    local = build_gpt_chunks(arch, layout, runtime.device)
    save_model(root / "base", local, arch)
    with te_spec_models():
        te = build_gpt_chunks(arch, layout, runtime.device)
    load_model(root / "base", te)
    local_model, te_model = unwrap(local[0]), unwrap(te[0])
    qkv = te_model.decoder.layers[0].self_attention.linear_qkv
    fc1 = te_model.decoder.layers[0].mlp.linear_fc1
    out: dict = {
        "te_class": type(qkv).__name__,
        "fused": [fuses_norm(m) for m in (qkv, fc1)],
        "local_fused": fuses_norm(local_model.decoder.layers[0].self_attention.linear_qkv),
    }
    for chunks in (local, te):
        _lora(chunks, arch)
    out["return_layernorm_output"] = bool(qkv.return_layernorm_output)
    out["keys"] = {
        name: sorted(unwrap(c[0]).lora.state_dict()) for name, c in (("local", local), ("te", te))
    }
    out["sharded_keys"] = {
        name: sorted(
            v.key for v in adapter_sharded_state_dict(model_sharded_state_dict(c))["model"].values()
        )
        for name, c in (("local", local), ("te", te))
    }
    norm_storages = {
        p.untyped_storage().data_ptr() for n, p in te_model.named_parameters() if "layer_norm" in n
    }
    out["lora_shares_a_norm_tensor"] = any(
        t.untyped_storage().data_ptr() in norm_storages
        for t in [*te_model.lora.parameters(), *te_model.lora.buffers()]
    )
    out["fingerprints"] = [base_fingerprint(c) for c in (local, te)]

    # The adapter of fc1 (layer 0) sees TE's returned norm output; its term is B·A of it.
    adapter = te_model.lora.layers["0"]["mlp__linear_fc1"]
    seen = {}
    adapter.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    fc1_io = {}

    def record(module, args, output):  # registered after the adapter's hook: sees its result
        fc1_io.setdefault("input", args[0].detach())
        fc1_io.setdefault("output", output[0].detach())

    fc1.register_forward_hook(record)
    out["local_losses"], out["local_grads"] = _forward_backward(local)
    out["te_losses"], out["te_grads"] = _forward_backward(te)
    out["adapter_input_is_te_norm_output"] = seen["x"] is fc1.last_layernorm_output
    with adapters_disabled(te), torch.no_grad():
        base_out, _ = fc1(fc1_io["input"])
    # Under SP the adapter's input is this rank's sequence chunk; A's output is gathered.
    x = seen["x"].detach()
    u = [x @ adapter.adapters[n].lora_A.t() for n in ("gate_proj", "up_proj")]
    if sequence_parallel:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        u = [gather_from_sequence_parallel_region(t) for t in u]
    bs = [adapter.adapters[n].lora_B for n in ("gate_proj", "up_proj")]
    by_hand = torch.cat([t @ b.t() for t, b in zip(u, bs, strict=True)], dim=-1)
    out["adapter_term"] = (fc1_io["output"], by_hand * adapter.scaling, base_out)
    batch = make_batch(0)
    with adapters_disabled(local), torch.no_grad():
        out["base_losses"] = local_model(
            batch["tokens"], batch["position_ids"], None, labels=batch["labels"]
        )

    # Adapters-only checkpoints: local -> TE and TE -> local.
    with torch.no_grad():
        for i, p in enumerate(local_model.lora.parameters()):
            p.add_(0.01 * (i + 1))
    for src, dst, name in ((local, te, "local_to_te"), (te, local, "te_to_local")):
        ckpt = root / name
        save_sharded(adapter_sharded_state_dict(model_sharded_state_dict(src)), ckpt)
        base_rec = base_record(str(root / "base"), base_fingerprint(src))  # collective
        if rank == 0:
            (ckpt / BASE_FILE).write_text(json.dumps(base_rec))
        torch.distributed.barrier()
        check_same_base(ckpt, base_fingerprint(dst))
        for p in unwrap(dst[0]).lora.parameters():
            p.data.zero_()
        load_adapters(ckpt, dst)
        src_state, dst_state = unwrap(src[0]).lora.state_dict(), unwrap(dst[0]).lora.state_dict()
        out[name] = all(torch.equal(src_state[k], dst_state[k]) for k in src_state)
        out[f"{name}_ckpt_keys"] = sorted(
            FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
        )
    teardown()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tp1 = run_multirank(_worker, 1, str(tmp_path_factory.mktemp("te1")), False, timeout=240)
    tp2 = run_multirank(_worker, 2, str(tmp_path_factory.mktemp("te2")), True, timeout=240)
    return {"tp1": tp1[0], "tp2_sp": tp2[0], "tp2_sp_rank1": tp2[1]}


LAYOUTS = ("tp1", "tp2_sp", "tp2_sp_rank1")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_te_spec_has_fused_norm_linears(results, layout):
    r = results[layout]
    assert r["te_class"] == "TELayerNormColumnParallelLinear"
    assert r["fused"] == [True, True] and not r["local_fused"]
    assert r["return_layernorm_output"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_adapter_keys_are_the_same_under_both_specs_and_hold_no_base_tensor(results, layout):
    r = results[layout]
    assert r["keys"]["te"] == r["keys"]["local"]
    assert all(k.endswith(("lora_A", "lora_B")) for k in r["keys"]["te"]), r["keys"]["te"]
    assert r["sharded_keys"]["te"] == r["sharded_keys"]["local"]
    assert all(k.startswith("lora.") and "norm" not in k for k in r["sharded_keys"]["te"])
    assert not r["lora_shares_a_norm_tensor"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_adapter_reads_te_norm_output_without_recomputing_it(results, layout):
    r = results[layout]
    assert r["adapter_input_is_te_norm_output"]
    with_adapter, term, base = r["adapter_term"]
    torch.testing.assert_close(with_adapter, base + term, rtol=RTOL, atol=1e-6)
    assert term.abs().max() > 1e-2  # the adapter contributes


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_on_te_equals_lora_on_the_local_spec(results, layout):
    r = results[layout]
    torch.testing.assert_close(r["te_losses"], r["local_losses"], rtol=RTOL, atol=1e-6)
    assert (r["local_losses"] - r["base_losses"]).abs().max() > 1e-3  # adapters matter
    assert r["te_grads"].keys() == r["local_grads"].keys()
    for k, g in r["local_grads"].items():
        assert g.abs().max() > 0, k
        torch.testing.assert_close(r["te_grads"][k], g, rtol=1e-4, atol=1e-7, msg=k)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_adapters_only_checkpoints_resume_across_specs(results, layout):
    r = results[layout]
    local_fp, te_fp = r["fingerprints"]
    assert local_fp[0] == te_fp[0]
    assert all(abs(a - b) <= 1e-12 * max(abs(a), 1.0) for a, b in zip(local_fp, te_fp))
    assert r["local_to_te"] and r["te_to_local"]
    for name in ("local_to_te", "te_to_local"):
        keys = r[f"{name}_ckpt_keys"]
        assert keys and all(k.startswith("lora.layers.") and "norm" not in k for k in keys)
    assert r["local_to_te_ckpt_keys"] == r["te_to_local_ckpt_keys"]
