"""The loss path never waits for the device: no host<->device synchronisation per micro-batch.

`tests/sync_guard.HostSyncGuard` records every call that would block the host on a GPU
(`.item()`, `.tolist()`, `float(t)`, `torch.tensor(data, device=...)`, ...) while the
reference pass and the KTO/DPO loss-and-metrics pass run through megatron-core's schedule with
several micro-batches. The only read-back allowed is the step's single metrics finalisation,
after the metric sums have been reduced.

Before this test existed the guard found two per micro-batch/step on this path:
`torch.tensor(n, device=...)` for the KL-row count (kto_model.kl_reference_point) and
`torch.as_tensor(python_int, device=...)` for metric counts (losses/metrics.MetricSums.pack).

Batches enter the model as the trainer hands them over: through `schedule.to_device`, which
records the host-side facts (scored positions and packed lengths per row) that selection and
packing use instead of reading the device. Both micro-batch layouts are checked: padded, and
packed (`models.packing`), on one rank and on two (TP=2 with and without sequence parallelism,
PP=2). Packed micro-batches pass THD parameters to megatron's attention; its *unfused* THD RoPE
(`rope_utils._apply_rotary_pos_emb_thd`, run without Transformer Engine) reads `cu_seqlens` on
the host — four syncs per layer and micro-batch, which the guard is shown to see — so our non-TE
layer specs rotate packed queries and keys with `models.packed_rope` instead, which reads
nothing. No file is left out for packed runs.

Context parallelism (CP=2, two ranks), MoE router statistics (one rank, and PP=2 where they
are all-reduced over the stages) and LoRA (reference = adapters off) run under the guard too.
The CP steps showed three per-micro-batch syncs before `models.context_parallel` built its
indices on the device and counted each rank's scored positions on the host: the output layer's
`nonzero()`, and the host-built keep and reorder indices copied to the device (the latter in
every layer) — 50 records on rank 0's padded KTO step. Router statistics and LoRA showed none.
"""

from __future__ import annotations

import pytest
import torch
from multirank import run_multirank
from sync_guard import HostSyncGuard
from test_kto_model import VOCAB, _batch, _settings

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
from megatron_kto.models.dpo_model import (
    REF_CHOSEN,
    REF_REJECTED,
    DPOSettings,
    MegatronGPTDPOModel,
)
from megatron_kto.models.kto_model import REF_KL, REF_SAMPLES, MegatronGPTKTOModel
from megatron_kto.models.packed_rope import PackedRoPE, PackedRoPESelfAttention
from megatron_kto.models.reference import CPUSwapReference
from megatron_kto.models.schedule import to_device
from megatron_kto.models.training_setup import wrap_ddp
from megatron_kto.runtime import init_runtime, teardown

# megatron-core's RNG tracker compares two *host* RNG-state tensors with `.item()` on leaving
# `fork()` (tensor_parallel/random.py); on a GPU those stay on the host, so it is no sync there.
HOST_ONLY = ("megatron/core/tensor_parallel/random.py",)
#: megatron-core's unfused RoPE (what packed runs without Transformer Engine used to call).
ROPE_UTILS = "megatron/core/models/common/embeddings/rope_utils.py"
# Under context parallelism megatron-core's RoPE slices its angle table for this rank's chunks
# (padded micro-batches, once per forward) with an index it copies from *pinned* host memory,
# non-blocking: an asynchronous copy on a GPU, which the guard cannot tell from a blocking one.
CP_ROPE_SLICE = " get_pos_emb_on_this_cp_rank"
# megatron-core's dropless MoE reads each layer's tokens per expert on the host — its all-to-all
# dispatcher (`sort_chunks_by_idxs` splits) and `SequentialMLP` (one GEMM per expert) need the
# sizes; that is megatron's own per-layer sync point, the same with and without our router
# statistics. Only these two places are left out: megatron's `MoEAuxLossAutoScaler`, which our
# router statistics go through, lives in the same moe_utils.py and stays guarded.
MOE_DISPATCH = (" sort_chunks_by_idxs", "megatron/core/transformer/moe/experts.py")


@pytest.fixture(scope="module")
def runtime():
    rt = init_runtime(1, 1, seed=11)
    yield rt
    teardown()


def test_guard_records_what_blocks_and_nothing_else() -> None:
    x = torch.ones(3)
    original_item = torch.Tensor.item
    with HostSyncGuard() as guard:
        torch.tensor(2.0, device="cpu")  # host->device copy on a GPU
        x.sum().item()
        float(x[0])
        bool(x[0] > 0)
        x.tolist()
        torch.full((), 2.0, device="cpu")  # a fill kernel: fine
        torch.tensor([1.0, 2.0])  # host tensor from host data: fine
        x.double()
    assert [c.name.split(".")[-1] for c in guard.calls] == [
        "tensor",
        "item",
        "__float__",
        "__bool__",
        "tolist",
    ], guard.report()
    assert torch.Tensor.item is original_item  # patches are undone
    with HostSyncGuard(ignore=("test_hot_loop_sync.py",)) as guard:
        x.sum().item()
    assert guard.calls == []
    # Host->device moves: recorded when non-blocking to a named device (what a host-built index
    # copied to the GPU looks like); dtype casts and plain moves are not.
    with HostSyncGuard() as guard:
        x.to("cpu", non_blocking=True)
        x.to(device=torch.device("cpu"), non_blocking=True)
        x.to(torch.device("cpu"), torch.float64, True)
        x.to(torch.float64, non_blocking=True)
        x.to("cpu")
    assert [c.name for c in guard.calls] == ["Tensor.to"] * 3, guard.report()


def _thd_rope_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[t, heads, d] queries, the cu_seqlens of rows 5, 1, 9 + a padding segment of 3, and
    megatron's angle table for them (as `GPTModel` builds it for a packed micro-batch)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    table = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)(9)
    return torch.randn(18, 2, 8), cu, table


def test_guard_sees_megatron_unfused_thd_rope(runtime) -> None:
    """What packed runs without Transformer Engine did per layer before `models.packed_rope`:
    megatron's unfused THD RoPE reads `cu_seqlens` on the host (`.tolist()`, and a Python branch
    on a tensor comparison) — two synchronisations per call, one call each for queries and keys."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    t, cu, table = _thd_rope_inputs()
    cp = parallel_state.get_context_parallel_group()
    with HostSyncGuard() as guard:
        _apply_rotary_pos_emb_thd(t, cu, table, cp_group=cp)
    assert sorted(c.name for c in guard.calls) == ["Tensor.__bool__", "Tensor.tolist"]
    assert all(ROPE_UTILS in c.where for c in guard.calls), guard.report()


def test_own_packed_rope_reads_nothing_on_the_host(runtime) -> None:
    from megatron.core import parallel_state

    from megatron_kto.models.builder import make_transformer_config

    t, cu, table = _thd_rope_inputs()
    config = make_transformer_config(GPTArchitecture(vocab_size=VOCAB), ParallelLayout())
    rope = PackedRoPE(table, table, cu, cu)
    cp = parallel_state.get_context_parallel_group()
    with HostSyncGuard() as guard:
        rope.rotate(t.unsqueeze(1), t.unsqueeze(1), config, cp)
    assert guard.calls == [], guard.report()


def _kto_model(runtime, micro_batch_size: int, pack: bool):
    arch = GPTArchitecture(vocab_size=VOCAB)
    chunks = wrap_ddp(build_gpt_chunks(arch, ParallelLayout(), runtime.device), False)
    settings = _settings(micro_batch_size, pack_sequences=pack)
    return MegatronGPTKTOModel(chunks, CPUSwapReference(chunks), settings)


def _device_batch(runtime) -> dict:
    """`test_kto_model._batch` with rows of different lengths, as the trainer hands it over."""
    batch = _batch()
    for i in range(4):
        batch["sample_labels"][i, 11 - i :] = -100
        batch["kl_sample_labels"][i, 11 - 2 * i :] = -100
    return to_device(batch, runtime.device)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("forward_only", [False, True])
def test_kto_step_has_no_host_sync_before_its_metrics(runtime, forward_only, pack) -> None:
    model = _kto_model(runtime, micro_batch_size=1, pack=pack)  # 4 micro-batches
    batch = _device_batch(runtime)
    with HostSyncGuard(ignore=HOST_ONLY) as guard:
        ref = model.get_ref_policy_logprobs(batch)  # cpu_swap reference pass
        batch[REF_SAMPLES], batch[REF_KL] = ref.chunk(2)
        sums, scalars = model.get_loss_and_metric_sums(batch, forward_only=forward_only)
    assert guard.calls == [], guard.report()

    # The same numbers come out of the public call, which then reads them back once.
    batch2 = _device_batch(runtime)
    batch2[REF_SAMPLES], batch2[REF_KL] = ref.chunk(2)
    with HostSyncGuard(ignore=HOST_ONLY) as guard:
        loss, metrics = model.get_loss_and_metrics(batch2, forward_only=True)
    assert {c.where.split(" ")[-1] for c in guard.calls} <= {"finalize", "finalize_kto_metrics"}
    assert metrics["kl"] == pytest.approx(scalars["kl"].item())


# The mixture reads the token counts of both completions (sigmoid_norm, sft) and ε (robust).
@pytest.mark.parametrize(
    "loss_type,eps",
    [("sigmoid", 0.0), (("robust", "sigmoid_norm", "sft"), 0.1)],
    ids=["sigmoid", "mix"],
)
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_dpo_step_has_no_host_sync_before_its_metrics(runtime, pack, loss_type, eps) -> None:
    arch = GPTArchitecture(vocab_size=VOCAB)
    chunks = wrap_ddp(build_gpt_chunks(arch, ParallelLayout(), runtime.device), False)
    settings = DPOSettings(
        beta=0.1,
        loss_type=loss_type,
        label_smoothing=eps,
        average_log_probs=False,
        sft_loss_weight=0.5,
        micro_batch_size=1,
        forward_micro_batch_size=2,
        vocab_size=VOCAB,
        pack_sequences=pack,
    )
    model = MegatronGPTDPOModel(chunks, CPUSwapReference(chunks), settings)
    batch = _dpo_batch(runtime.device)
    with HostSyncGuard(ignore=HOST_ONLY) as guard:
        ref = model.get_ref_policy_logprobs(batch)
        batch[REF_CHOSEN], batch[REF_REJECTED] = ref.chunk(2)
        model.get_loss_and_metric_sums(batch, forward_only=False)
    assert guard.calls == [], guard.report()


#: (name, TP, PP, sequence parallel) of the packed runs on two ranks.
PACKED_LAYOUTS = [("tp2", 2, 1, False), ("tp2_sp", 2, 1, True), ("pp2", 1, 2, False)]


def _packed_step_syncs(rank: int, world_size: int) -> dict:
    """Per layout: one packed KTO step (reference pass, then forward + backward over 4
    micro-batches) with our attention modules, then the same step with them switched back to
    megatron's `SelfAttention`: the guard's records of each, and how many of ours ran."""
    from megatron.core.transformer.attention import SelfAttention

    out = {}
    for name, tp, pp, sp in PACKED_LAYOUTS:
        rt = init_runtime(tp, pp, seed=11)
        layout = ParallelLayout(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp
        )
        chunks = wrap_ddp(
            build_gpt_chunks(GPTArchitecture(vocab_size=VOCAB), layout, rt.device), False
        )
        settings = _settings(micro_batch_size=1, pack_sequences=True)
        model = MegatronGPTKTOModel(chunks, CPUSwapReference(chunks), settings)
        attentions = [m for c in chunks for m in c.modules() if isinstance(m, SelfAttention)]
        out[name] = {"ours": sum(type(m) is PackedRoPESelfAttention for m in attentions)}
        for attention in ("packed_rope", "megatron"):
            if attention == "megatron":
                for m in attentions:
                    m.__class__ = SelfAttention
            batch = _device_batch(rt)
            with HostSyncGuard(ignore=HOST_ONLY) as guard:
                ref = model.get_ref_policy_logprobs(batch)
                batch[REF_SAMPLES], batch[REF_KL] = ref.chunk(2)
                model.get_loss_and_metric_sums(batch, forward_only=False)
            out[name][attention] = [f"{c.name} at {c.where}" for c in guard.calls]
    teardown()
    return out


@pytest.mark.multirank
def test_packed_steps_under_tp_sp_pp_have_no_host_sync() -> None:
    """Packed KTO steps on two ranks (TP=2, TP=2 with sequence parallelism — packed lengths
    padded to a multiple of TP — and PP=2 — micro-batches padded to a common length) make no
    host synchronisation before their metrics; the same steps through megatron's unfused THD
    RoPE do, all of them in `rope_utils`, so the guard would see a regression on every layout."""
    reports = run_multirank(_packed_step_syncs, 2, timeout=300)
    for rank, report in enumerate(reports):
        for name, got in report.items():
            assert got["ours"] > 0, f"rank {rank} {name}: no PackedRoPESelfAttention built"
            assert got["packed_rope"] == [], f"rank {rank} {name}:\n" + "\n".join(
                got["packed_rope"]
            )
            assert got["megatron"], f"rank {rank} {name}: the guard saw megatron's RoPE do nothing"
            assert all(ROPE_UTILS in where for where in got["megatron"]), got["megatron"]


def _moe_arch() -> GPTArchitecture:
    """The default tiny model with 4 experts (top-2) in every layer."""
    return GPTArchitecture(vocab_size=VOCAB, num_moe_experts=4, moe_ffn_hidden_size=32)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("case", ["moe_router_stats", "lora"])
def test_router_statistics_and_lora_steps_have_no_host_sync(runtime, case, pack) -> None:
    """A KTO training step of an MoE model with the router load-balancing loss
    (`models.router_stats`: hooks on every router, the final token appended to each row), and
    one of a LoRA model whose reference is the same chunks with the adapters off — reference
    pass, KL pass, forward + backward over 4 micro-batches — make no host synchronisation
    before their metrics (megatron's own MoE dispatch left out: `MOE_DISPATCH`); the aux loss
    is then read back with them."""
    from megatron_kto.peft.reference import AdaptersOffReference
    from megatron_kto.peft.wiring import LoRASettings, apply_lora

    moe = case == "moe_router_stats"
    arch = _moe_arch() if moe else GPTArchitecture(vocab_size=VOCAB)
    chunks = build_gpt_chunks(arch, ParallelLayout(), runtime.device)
    if not moe:
        apply_lora(chunks, arch, LoRASettings(rank=4, alpha=8.0, init_b="xavier"))
    chunks = wrap_ddp(chunks, False)
    reference = CPUSwapReference(chunks) if moe else AdaptersOffReference(chunks)
    settings = _settings(1, pack_sequences=pack, router_aux_loss_coeff=0.01 if moe else 0.0)
    model = MegatronGPTKTOModel(chunks, reference, settings)
    assert (model.router_stats is not None) == moe
    batch = _device_batch(runtime)
    with HostSyncGuard(ignore=HOST_ONLY + MOE_DISPATCH) as guard:
        ref = model.get_ref_policy_logprobs(batch)
        batch[REF_SAMPLES], batch[REF_KL] = ref.chunk(2)
        sums, scalars = model.get_loss_and_metric_sums(batch, forward_only=False)
    assert guard.calls == [], guard.report()
    metrics = model.finalize_metrics(sums, scalars)
    assert ("aux_loss" in metrics) == moe
    assert metrics["loss"] > 0


def _two_rank_step_syncs(rank: int, world_size: int) -> dict:
    """Training steps on two ranks under the guard (reference pass, KL pass, forward + backward
    over several micro-batches): at CP=2, KTO and DPO with padded and packed micro-batches; at
    PP=2, an MoE KTO step with the router load-balancing loss, whose statistics are all-reduced
    over the pipeline stages. Per step: the guard's records, and how many micro-batches reached
    the output layer with / without a host-known scored count."""
    from megatron_kto.models import output_head

    counted = []
    real = output_head.scored_positions

    def scored_positions(labels, num_scored):
        counted.append(num_scored is not None)
        return real(labels, num_scored)

    output_head.scored_positions = scored_positions
    out = {}

    def run(key, step, chunks, pack, batch, ignore):
        counted.clear()
        with HostSyncGuard(ignore=(*HOST_ONLY, *ignore)) as guard:
            step(chunks, pack, batch)
        out[key] = {
            "calls": [f"{c.name} at {c.where}" for c in guard.calls],
            "host_counts": counted.count(True),
            "device_counts": counted.count(False),
        }

    rt = init_runtime(1, 1, seed=11, context_parallel_size=2)
    layout = ParallelLayout(context_parallel_size=2, attention_backend="sdpa")
    for pack in (False, True):
        for algorithm in ("kto", "dpo"):
            chunks = wrap_ddp(
                build_gpt_chunks(GPTArchitecture(vocab_size=VOCAB), layout, rt.device), False
            )
            # Batches arrive as the trainer hands them over (`to_device`, outside the loop).
            if algorithm == "kto":
                step, batch = _kto_step, _device_batch(rt)
            else:
                step, batch = _dpo_step, _dpo_batch(rt.device)
            key = f"cp2/{algorithm}/{'packed' if pack else 'padded'}"
            run(key, step, chunks, pack, batch, (CP_ROPE_SLICE,))
    rt = init_runtime(1, 2, seed=11)
    layout = ParallelLayout(pipeline_model_parallel_size=2)
    # The router statistics' own process group is made once, when the trainer builds the model
    # (a world-wide exchange of rank lists), not in a step: made here, outside the guard.
    from megatron.core import parallel_state

    from megatron_kto.models.router_stats import own_group

    own_group(parallel_state.get_pipeline_model_parallel_group())
    for pack in (False, True):
        chunks = wrap_ddp(build_gpt_chunks(_moe_arch(), layout, rt.device), False)
        key = f"pp2_moe_router_stats/kto/{'packed' if pack else 'padded'}"
        run(key, _kto_step, chunks, pack, _device_batch(rt), MOE_DISPATCH)
    output_head.scored_positions = real
    teardown()
    return out


def _kto_step(chunks, pack: bool, batch: dict) -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    moe = any(isinstance(m, TopKRouter) for c in chunks for m in c.modules())
    settings = _settings(1, pack_sequences=pack, router_aux_loss_coeff=0.01 if moe else 0.0)
    model = MegatronGPTKTOModel(chunks, CPUSwapReference(chunks), settings)
    ref = model.get_ref_policy_logprobs(batch)
    batch[REF_SAMPLES], batch[REF_KL] = ref.chunk(2)
    model.get_loss_and_metric_sums(batch, forward_only=False)


def _dpo_batch(device) -> dict:
    kto = _batch()
    batch = {
        "chosen": kto["samples"],
        "rejected": kto["kl_samples"],
        "chosen_labels": kto["sample_labels"],
        "rejected_labels": kto["kl_sample_labels"],
        "position_ids": kto["position_ids"],
    }
    batch["rejected_labels"][:, 8:] = -100  # shorter rejected rows
    return to_device(batch, device)


def _dpo_step(chunks, pack: bool, batch: dict) -> None:
    settings = DPOSettings(
        beta=0.1, loss_type="sigmoid", label_smoothing=0.0, average_log_probs=False,
        sft_loss_weight=0.5, micro_batch_size=1, forward_micro_batch_size=2,
        vocab_size=VOCAB, pack_sequences=pack,
    )  # fmt: skip
    model = MegatronGPTDPOModel(chunks, CPUSwapReference(chunks), settings)
    ref = model.get_ref_policy_logprobs(batch)
    batch[REF_CHOSEN], batch[REF_REJECTED] = ref.chunk(2)
    model.get_loss_and_metric_sums(batch, forward_only=False)


@pytest.mark.multirank
def test_context_parallel_and_pipelined_router_steps_have_no_host_sync() -> None:
    """KTO and DPO training steps at CP=2 (padded and packed micro-batches, our SDPA context-
    parallel attention) and MoE KTO steps with router statistics at PP=2 make no host
    synchronisation before their metrics (megatron's own MoE dispatch left out: `MOE_DISPATCH`).
    Before this test the guard found, per CP micro-batch: the output layer's `nonzero()` (the
    scored count was dropped by the split) and the host-built CP index copied to the device —
    the split's, and the key reorder's in every layer. Every micro-batch now reaches the output
    layer with this rank's scored count known on the host."""
    reports = run_multirank(_two_rank_step_syncs, 2, timeout=300)
    for rank, report in enumerate(reports):
        assert len(report) == 6, sorted(report)
        for key, got in report.items():
            assert got["calls"] == [], f"rank {rank} {key}:\n" + "\n".join(got["calls"])
            # PP=2: the first stage has no output layer.
            if key.startswith("cp2") or rank == 1:
                assert got["host_counts"] > 0, (rank, key, got)
            assert got["device_counts"] == 0, (rank, key, got)


def test_cuda_runs_load_batches_into_pinned_memory(tmp_path) -> None:
    """`build_split` asks for pinned batches exactly when the run's device is CUDA, so the
    trainer's `to_device(non_blocking=True)` copies are asynchronous there."""
    from pathlib import Path
    from types import SimpleNamespace

    from megatron_kto.data.pipeline import build_split
    from megatron_kto.data.tokenizers import load_tokenizer
    from megatron_kto.entry import compose_run_config

    repo = Path(__file__).resolve().parents[1]
    cfg = compose_run_config("gpt_kto", ["example=tiny_kto", "model.data.use_cache=false"]).cfg
    tokenizer = load_tokenizer("sentencepiece", str(repo / cfg.model.tokenizer.model))
    for device, pinned in (("cpu", False), ("cuda", True)):
        runtime = SimpleNamespace(
            device=torch.device(device), local_rank=0, data_parallel_rank=0, data_parallel_size=1
        )
        split = build_split(cfg, "validation", "kto", tokenizer, runtime, 128)
        assert split.loader().pin_memory is pinned
