"""What our context parallelism hands Transformer Engine's attention, run on CPU: megatron-core's
TE layer spec at CP=2 with megatron's real `TEDotProductAttention` over a TE 2.9 stand-in
(`te_attention_standin`) that checks TE's CP contract and computes what TE computes.

One spawn of 2 gloo ranks, fp32. The same weights take one KTO and one DPO step (reference pass,
KL pass, training pass with backward; padded and packed micro-batches, rows of 3..16 tokens
padded to multiples of 2·CP) twice — through the local spec with `SDPAttention` at CP=1 × DP=2
(never splitting a row), and through the TE spec at CP=2 — via `test_context_parallel._run`,
i.e. `MegatronGPTKTOModel` / `MegatronGPTDPOModel`, megatron's schedule and DDP.

Shown:

* what reaches TE: packed micro-batches as `thd` + `padding_causal` with `cu_seqlens_*_padded`
  (every segment a multiple of 2·CP), padded ones as `sbhd` + `causal` (the run sends both to TE
  under CP: `choose_attention_backend` picks TE for either); the CP group's ranks, the stream
  and `cp_comm_type="p2p"` (the only type TE 2.9 takes with `thd`);
* per-row reference log-probs, every metric and every gradient equal CP=1's to 1e-5;
* the stand-in can tell: a contiguous (not dual-chunk) split gives other outputs than CP=1, and
  inputs TE would refuse raise `TEContractError`.
"""

from __future__ import annotations

import pytest
import torch
from multirank import run_multirank

pytestmark = pytest.mark.multirank

TOL = 1e-5
RUNS = ("kto_padded", "kto_packed", "dpo_padded", "dpo_packed")
#: TE-spec parameter name -> local-spec name (the norms fused into TE's linears).
TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def _local_name(name: str) -> str:
    for te, local in TE_TO_LOCAL.items():
        name = name.replace(te, local)
    return name


def _weights(policy, reference) -> dict[str, torch.Tensor]:
    """Policy and reference weights by local-spec name."""
    from megatron_kto.models.builder import unwrap

    return {
        f"{kind}.{_local_name(n)}": p
        for kind, chunks in (("policy", policy), ("reference", reference))
        for n, p in unwrap(chunks[0]).named_parameters()
    }


def _te_chunks_with(weights: dict[str, torch.Tensor]):
    """`test_context_parallel._chunks` that loads `weights` (by local name) into what it builds:
    the TE spec draws its initial weights in another order than the local spec."""
    import test_context_parallel

    build = test_context_parallel._chunks

    def chunks(rt, tp: int, pp: int, cp: int, sp: bool):
        policy, reference = build(rt, tp, pp, cp, sp)
        mine = _weights(policy, reference)
        if sorted(mine) != sorted(weights):
            raise AssertionError(f"parameters differ: {sorted(set(mine) ^ set(weights))}")
        with torch.no_grad():
            for name, p in mine.items():
                p.copy_(weights[name])
        return policy, reference

    return chunks


def _calls() -> dict:
    """What the TE stand-in was handed since the last reset (a summary)."""
    import te_attention_standin as standin

    calls = standin.CALLS
    return {
        "count": len(calls),
        "kinds": sorted({(c["qkv_format"], c["attn_mask_type"], c["cp_size"]) for c in calls}),
        "cp": sorted({(tuple(c["cp_global_ranks"]), c["cp_comm_type"]) for c in calls}),
        "stream": all(isinstance(c["cp_stream"], standin.CPStream) for c in calls),
        "padded_lengths": sorted({n for c in calls for n in c["padded_lengths"]}),
        "padding_tokens": sum(
            n - r for c in calls for n, r in zip(c["padded_lengths"], c["real_lengths"])
        ),
    }


def _layout_probe(rank: int) -> dict:
    """The stand-in alone on random q/k/v ([t, h, d], segments of 8, 4 and 12 tokens): a
    dual-chunk split equals CP=1, a contiguous one does not; inputs TE refuses raise."""
    from megatron.core import parallel_state
    from te_attention_standin import CPStream, DotProductAttention, TEContractError

    group = parallel_state.get_context_parallel_group()
    ranks = torch.distributed.get_process_group_ranks(group)
    cp = group.size()
    lengths = [8, 4, 12]
    cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(24, 4, 8, generator=g) for _ in range(3))
    whole = DotProductAttention(4, 8, num_gqa_groups=2, attn_mask_type="padding_causal")
    k, v = k[:, :2], v[:, :2]
    want = whole(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12)
    split = DotProductAttention(
        4, 8, num_gqa_groups=2, attn_mask_type="padding_causal",
        cp_group=group, cp_global_ranks=ranks, cp_stream=CPStream(),
    )  # fmt: skip

    def run(index: list[int], **kwargs) -> torch.Tensor:
        args = {"qkv_format": "thd", "cu_seqlens_q": cu, "cu_seqlens_kv": cu,
                "cu_seqlens_q_padded": cu, "cu_seqlens_kv_padded": cu, "max_seqlen_q": 12}  # fmt: skip
        args.update(kwargs)
        return split(q[index], k[index], v[index], **args)

    dual, contiguous, start = [], [], 0
    for n in lengths:
        c = n // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            dual += range(start + chunk * c, start + (chunk + 1) * c)
        contiguous += range(start + rank * n // cp, start + (rank + 1) * n // cp)
        start += n
    out = {
        "dual_err": (run(dual) - want[dual]).abs().max().item(),
        "contiguous_err": (run(contiguous) - want[contiguous]).abs().max().item(),
    }
    refused = {}
    bad_cu = torch.tensor([0, 6, 12, 24], dtype=torch.int32)  # a segment of 6: not 2·CP·n
    cases = {
        "no_padded_cu_seqlens": {"cu_seqlens_q_padded": None, "cu_seqlens_kv_padded": None},
        "segment_not_multiple": {"cu_seqlens_q": bad_cu, "cu_seqlens_kv": bad_cu,
                                 "cu_seqlens_q_padded": bad_cu, "cu_seqlens_kv_padded": bad_cu},
        "causal_without_padding": {"attn_mask_type": "causal"},
        "int64_cu_seqlens": {"cu_seqlens_q": cu.long(), "cu_seqlens_kv": cu.long()},
    }  # fmt: skip
    for name, kwargs in cases.items():
        try:
            run(dual, **kwargs)
        except TEContractError as err:
            refused[name] = str(err)
    split.cp_comm_type = "all_gather"
    try:
        run(dual)
    except TEContractError as err:
        refused["thd_all_gather"] = str(err)
    try:
        DotProductAttention(4, 8, cp_group=group, cp_global_ranks=ranks[::-1], cp_stream=None)
    except TEContractError as err:
        refused["wrong_ranks"] = str(err)
    out["refused"] = refused
    return out


def _worker(rank: int, world_size: int) -> dict:
    import te_attention_standin as standin
    import test_context_parallel
    from megatron.core import parallel_state
    from te_standin import te_spec_models
    from test_context_parallel import _compare, _run

    from megatron_kto.runtime import init_runtime, teardown

    rt = init_runtime(1, 1, seed=3, context_parallel_size=1)
    want = {run: _run(rt, (1, 1, 1, False), run) for run in RUNS}
    local_chunks = test_context_parallel._chunks(rt, 1, 1, 1, False)
    local = {n: p.detach().clone() for n, p in _weights(*local_chunks).items()}
    rt = init_runtime(1, 1, seed=3, context_parallel_size=world_size)
    cp_group = parallel_state.get_context_parallel_group()
    out: dict = {"cp_ranks": torch.distributed.get_process_group_ranks(cp_group)}
    # This spawned process only: `_run` builds its chunks through the module's `_chunks`.
    test_context_parallel._chunks = _te_chunks_with(local)
    with te_spec_models(attention="te"):
        for run in RUNS:
            standin.reset_calls()
            got = _run(rt, (1, 1, world_size, False), run)
            got["grads"] = {_local_name(n): g for n, g in got["grads"].items()}
            out[run] = _compare(want[run], got)
            out[run]["calls"] = _calls()
    out["probe"] = _layout_probe(cp_group.rank())
    teardown()
    return out


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_multirank(_worker, 2, timeout=300)


@pytest.mark.parametrize("packed", [False, True])
def test_the_run_sends_both_kinds_of_micro_batch_to_te_under_cp(packed):
    """The premise: with TE on a Hopper GPU, bf16 and CP=2, `auto` picks TE for padded and
    packed micro-batches alike (the image's TE, as `test_attention_backend_matrix` states it)."""
    from te_standin import image_te_version

    from megatron_kto.runtime.attention_backend import AttentionFeatures, choose_attention_backend
    from megatron_kto.runtime.gpu_settings import Accelerator

    hopper = Accelerator(
        cuda=True, transformer_engine=image_te_version(), compute_capability=(9, 0)
    )
    choice = choose_attention_backend(
        "auto", precision="bf16", packed=packed, accelerator=hopper,
        features=AttentionFeatures(head_dim=64), context_parallel_size=2,
    )  # fmt: skip
    assert choice.backend == "te", choice


@pytest.mark.parametrize("run", RUNS)
def test_te_receives_its_cp_contract(reports, run):
    for rep in reports:
        calls = rep[run]["calls"]
        assert calls["count"] > 0, "TE's attention was not called"
        kind = ("thd", "padding_causal", 2) if run.endswith("packed") else ("sbhd", "causal", 2)
        assert calls["kinds"] == [kind]
        assert calls["cp"] == [(tuple(rep["cp_ranks"]), "p2p")]
        assert calls["stream"]
        assert calls["padded_lengths"] and all(n % 4 == 0 for n in calls["padded_lengths"])
        # Rows are padded to 2·CP inside their segments: TE sees no padding between sequences.
        assert calls["padding_tokens"] == 0


@pytest.mark.parametrize("run", RUNS)
def test_te_cp2_equals_local_cp1(reports, run):
    for rank, rep in enumerate(reports):
        got = rep[run]
        assert got["refs_scale"] > 1.0, "informative log-probs"
        assert got["refs_err"] <= TOL * got["refs_scale"], f"rank {rank}: reference {got}"
        for name, (value, want) in got["metrics"].items():
            assert abs(value - want) <= TOL * max(1.0, abs(want)), f"rank {rank}: {name}"
        assert got["grads"], "gradients compared"
        for name, (err, scale) in got["grads"].items():
            assert scale > 0, f"rank {rank}: {name} has no gradient"
            assert err <= TOL * scale, f"rank {rank}: {name} differs by {err} (max {scale})"


def test_standin_reads_the_dual_chunk_layout(reports):
    for rep in reports:
        probe = rep["probe"]
        assert probe["dual_err"] <= 1e-6
        assert probe["contiguous_err"] > 1e-2


def test_standin_refuses_what_te_refuses(reports):
    for rep in reports:
        refused = rep["probe"]["refused"]
        assert sorted(refused) == sorted(
            [
                "no_padded_cu_seqlens", "segment_not_multiple", "causal_without_padding",
                "int64_cu_seqlens", "thd_all_gather", "wrong_ranks",
            ]
        ), refused  # fmt: skip
        assert "2·CP" in refused["segment_not_multiple"]
        assert "p2p" in refused["thd_all_gather"]
