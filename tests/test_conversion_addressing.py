"""The addressing layer (`conversion/addressing.py`), pure: no process group, no model built.

Names (local and Transformer Engine grouped experts) parse and format back; a chunk's local
layer / expert numbering maps to the global one given plain offsets; every rank's Hugging Face
slices, filled in, equal its shard of the whole conversion; merging every rank's shard gives the
whole tensor back; LoRA's A/B axes follow the base linear's entry.
"""

from __future__ import annotations

import pytest
import torch

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import (
    COLUMN,
    EMBEDDING,
    FC1_WEIGHT,
    FC2_WEIGHT,
    LINEAR_MAPPINGS,
    LOCAL_NORMS,
    OUTPUT,
    PROJ_WEIGHT,
    QKV_WEIGHT,
    REPLICATED,
    ROW,
    TE_NORMS,
    ChunkLayout,
    ParamName,
    expert_owner,
    fill,
    lora_axes,
    megatron_sources,
    merge_shards,
    parse_name,
    shard_of,
    shard_reads,
)
from megatron_kto.conversion.mappings import to_megatron
from megatron_kto.conversion.registry import get_family


@pytest.mark.parametrize(
    "name,want",
    [
        ("embedding.word_embeddings.weight", ParamName("embedding.word_embeddings.weight")),
        (
            "decoder.layers.3.self_attention.linear_qkv.weight",
            ParamName("self_attention.linear_qkv.weight", 3),
        ),
        (
            "decoder.layers.12.mlp.experts.local_experts.5.linear_fc1.weight",
            ParamName("linear_fc1.weight", 12, 5),
        ),
        (
            "decoder.layers.0.mlp.experts.linear_fc2.weight17",
            ParamName("linear_fc2.weight", 0, 17, grouped=True),
        ),
        ("decoder.layers.1.mlp.router.weight", ParamName("mlp.router.weight", 1)),
        (
            "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
            ParamName("mlp.shared_experts.linear_fc1.weight", 1),
        ),
    ],
)
def test_names_parse_and_format_back(name, want):
    got = parse_name(name)
    assert got == want
    assert str(got) == name


def test_in_layer_is_what_the_family_table_keys():
    grouped = parse_name("decoder.layers.2.mlp.experts.linear_fc1.weight3")
    local = parse_name("decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight")
    assert grouped.in_layer == "mlp.experts.linear_fc1.weight3"
    assert local.in_layer == "mlp.experts.local_experts.3.linear_fc1.weight"
    assert str(local.renumbered(layer=7, expert=1)) == (
        "decoder.layers.7.mlp.experts.local_experts.1.linear_fc1.weight"
    )


@pytest.mark.parametrize("grouped", [False, True], ids=["local", "te_grouped"])
def test_local_to_global_with_offsets(grouped):
    """A chunk holding global layers 4 and 5 (pipeline stage 2 of 3 layers... as plain data) and
    the experts of EP rank 1 of 2 (8 experts: global 4..7)."""
    layout = ChunkLayout(layers=(4, 5), experts=(4, 5, 6, 7))
    local = (
        "decoder.layers.1.mlp.experts.linear_fc1.weight2"
        if grouped
        else "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"
    )
    want = (
        "decoder.layers.5.mlp.experts.linear_fc1.weight6"
        if grouped
        else "decoder.layers.5.mlp.experts.local_experts.6.linear_fc1.weight"
    )
    assert str(layout.to_global(local)) == want
    assert str(layout.to_global("decoder.layers.0.input_layernorm.weight")) == (
        "decoder.layers.4.input_layernorm.weight"
    )
    assert str(layout.to_global("output_layer.weight")) == "output_layer.weight"
    assert layout.local_layer(5) == 1
    assert expert_owner(6, num_experts=8, ep_size=2) == (1, 2)
    assert expert_owner(3, num_experts=8, ep_size=2) == (0, 3)


def test_chunk_layout_reads_a_models_numbering():
    """`ChunkLayout.of` reads megatron's 1-based global `layer_number` and the MoE layer's
    `local_expert_indices` (a dense layer has none)."""

    class Obj:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    layers = [
        Obj(layer_number=3, mlp=Obj()),
        Obj(layer_number=4, mlp=Obj(local_expert_indices=[2, 3])),
    ]
    model = Obj(decoder=Obj(layers=layers))
    assert ChunkLayout.of(model) == ChunkLayout((2, 3), (2, 3))


def _arch(**extra) -> GPTArchitecture:
    fields = dict(
        num_layers=2,
        hidden_size=16,
        ffn_hidden_size=24,
        num_attention_heads=8,
        num_query_groups=4,
        kv_channels=4,
        vocab_size=10,
        padded_vocab_size=16,
        add_qkv_bias=True,
    )
    return GPTArchitecture(**(fields | extra))


def _moe_arch() -> GPTArchitecture:
    return _arch(
        add_qkv_bias=False,
        qk_layernorm=True,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
    )


def _random_hf(generator: torch.Generator):
    hf: dict[str, torch.Tensor] = {}
    shapes = {"embed_tokens": (10, 16), "lm_head": (10, 16), "q_proj.weight": (32, 16),
              "q_proj.bias": (32,), "k_proj.weight": (16, 16), "k_proj.bias": (16,),
              "v_proj.weight": (16, 16), "v_proj.bias": (16,), "o_proj": (16, 32),
              "experts": None, "mlp.gate.weight": (4, 16), "gate_proj": (24, 16),
              "up_proj": (24, 16), "down_proj": (16, 24), "q_norm": (4,), "k_norm": (4,)}  # fmt: skip

    def get(name: str) -> torch.Tensor:
        shape = next((s for k, s in shapes.items() if k in name), (16,))
        if shape is None:  # an expert: width 8
            shape = (16, 8) if "down_proj" in name else (8, 16)
        return hf.setdefault(name, torch.randn(shape, generator=generator))

    return hf, get


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3_moe"])
@pytest.mark.parametrize("norms", [LOCAL_NORMS, TE_NORMS], ids=["local", "te"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_shard_reads_then_fill_equal_the_whole_conversion_sliced(model_type, norms, size):
    """Every rank's slices, each put in its place, equal that rank's shard (`shard_of`) of the
    tensor the whole conversion makes; merging all ranks' shards gives the whole tensor back."""
    arch = _moe_arch() if model_type == "qwen3_moe" else _arch()
    hf, get = _random_hf(torch.Generator().manual_seed(size))
    family = get_family(model_type)
    whole = dict(to_megatron(get, arch, arch.padded_vocab_size, norms, family))
    sources = megatron_sources(arch, norms, family)
    assert set(whole) <= set(sources)
    experts = [n for n in whole if sources[n].expert]
    assert bool(experts) == (model_type == "qwen3_moe")
    if norms is TE_NORMS:
        assert all(parse_name(n).grouped for n in experts)
    for name, full in whole.items():
        entry = sources[name]
        shards = []
        for rank in range(size):
            want = shard_of(full, entry.tp_axis, entry.kind, rank, size)
            got = torch.full_like(want, float("nan"))
            for i, r in enumerate(shard_reads(entry, arch, tuple(want.shape), rank, size)):
                index = [slice(None)] * hf[r.name].dim()
                if r.axis is not None:
                    index[r.axis] = slice(r.start, r.stop)
                fill(entry, arch, got, i, hf[r.name][tuple(index)], size)
            assert torch.equal(got, want), (name, rank, size)
            shards.append(got)
        assert torch.equal(merge_shards(shards, entry.tp_axis, entry.kind), full), name


def test_merge_un_interleaves_gated_mlp_shards():
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    full = torch.cat([gate, up])
    shards = [shard_of(full, COLUMN, "gated_mlp", r, 2) for r in range(2)]
    assert torch.equal(shards[0], torch.cat([gate[:2], up[:2]]))
    assert torch.equal(merge_shards(shards, COLUMN, "gated_mlp"), full)
    row = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(merge_shards([row[:, :2], row[:, 2:]], ROW, "direct"), row)
    assert merge_shards([row], REPLICATED, "direct") is row


def test_vocab_entries_and_tied_output():
    tied = megatron_sources(
        _arch(share_embeddings_and_output_weights=True), LOCAL_NORMS, get_family("qwen2")
    )
    assert tied[OUTPUT.megatron].hf == EMBEDDING.hf
    assert tied[EMBEDDING.megatron].kind == "vocab" and tied[EMBEDDING.megatron].tp_axis == COLUMN
    arch = _arch()
    last = shard_reads(EMBEDDING, arch, (4, 16), rank=3, size=4)  # padded rows 12..16 > vocab 10
    assert (last[0].start, last[0].stop) == (12, 12)


def test_lora_axes_follow_the_base_linears_entry():
    """Column-parallel base: A replicated, B sharded on outputs; row-parallel: A on inputs."""
    assert {e.megatron: lora_axes(e.tp_axis) for e in LINEAR_MAPPINGS} == {
        QKV_WEIGHT.megatron: (None, 0),
        FC1_WEIGHT.megatron: (None, 0),
        PROJ_WEIGHT.megatron: (1, None),
        FC2_WEIGHT.megatron: (1, None),
    }
    assert lora_axes(REPLICATED) == (None, None)
