"""`peft.merge.merge_lora`, the one LoRA merge: plain tensors in, the merged weight out.

Checked against numbers worked out by hand (a plain linear, a gated fc1 with one adapter, a
fused q/k/v with grouped-query attention), and against Hugging Face `peft`'s `merge_and_unload`
on a tiny random Llama (GQA): its per-projection weights fused into megatron's layout with the
conversion table's `fuse_qkv` / `fuse_fc1`, merged with our adapters' tensors, and split back
equal what `peft` merged — with adapters on every projection and on some of the fused ones.
"""

from __future__ import annotations

import pytest
import torch

from megatron_kto.conversion.mappings import fuse_fc1, fuse_qkv, split_fc1, split_qkv
from megatron_kto.peft.lora import FusedLayout
from megatron_kto.peft.merge import merge_lora


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_plain_linear_by_hand():
    """W = [[1, 0, 2], [0, 1, 0]], A = [[1, 2, 0]] (r = 1), B = [[1], [-1]], scale = 0.5:
    B·A = [[1, 2, 0], [-1, -2, 0]], so W + 0.5·B·A = [[1.5, 1, 2], [-0.5, 0, 0]]."""
    w = _t([[1, 0, 2], [0, 1, 0]])
    a, b = _t([[1, 2, 0]]), _t([[1], [-1]])
    merged = merge_lora(w, [(a, b)], 0.5)
    assert torch.equal(merged, _t([[1.5, 1, 2], [-0.5, 0, 0]]))
    assert torch.equal(w, _t([[1, 0, 2], [0, 1, 0]]))  # pure: the input is not modified


def test_gated_fc1_with_only_up_adapted_by_hand():
    """fc1 = [gate; up], 1 row each, in = 2. Only up has an adapter: A = [[1, 1]], B = [[3]],
    scale 2 -> up gains 2·3·[1, 1] = [6, 6]; gate's row is unchanged.
    W = [[1, 2], [3, 4]] -> [[1, 2], [9, 10]]."""
    w = _t([[1, 2], [3, 4]])
    merged = merge_lora(w, [None, (_t([[1, 1]]), _t([[3]]))], 2.0, FusedLayout("fc1"))
    assert torch.equal(merged, _t([[1, 2], [9, 10]]))


def test_fused_qkv_by_hand():
    """2 query groups of 1 head each, head dim 1, in = 1, W = 0: megatron's rows are per group
    [q, k, v] = [q0, k0, v0, q1, k1, v1]. Adapters (r = 1, scale 1): q with A = [[1]],
    B = [[1], [2]] (q0 += 1, q1 += 2); v with A = [[10]], B = [[1], [-1]] (v0 += 10,
    v1 -= 10); k none. Merged column: [1, 0, 10, 2, 0, -10]."""
    w = torch.zeros(6, 1)
    layout = FusedLayout("qkv", groups=2, heads_per_group=1, head_dim=1)
    q, v = (_t([[1]]), _t([[1], [2]])), (_t([[10]]), _t([[1], [-1]]))
    merged = merge_lora(w, [q, None, v], 1.0, layout)
    assert torch.equal(merged[:, 0], torch.tensor([1.0, 0, 10, 2, 0, -10]))


def test_product_in_float32_added_in_the_weights_dtype():
    """A bf16 weight gets the float32 product cast to bf16 once: W + bf16(scale·B·A)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 4, generator=g).bfloat16()
    a, b = torch.randn(2, 4, generator=g).bfloat16(), torch.randn(8, 2, generator=g).bfloat16()
    merged = merge_lora(w, [(a, b)], 4.0)
    assert merged.dtype == torch.bfloat16
    assert torch.equal(merged, w + ((b.float() @ a.float()) * 4.0).bfloat16())


def test_refuses_what_does_not_fit():
    w, pair = torch.zeros(4, 3), (torch.zeros(1, 3), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="no adapter"):
        merge_lora(torch.zeros(8, 3), [None, None], 1.0, FusedLayout("fc1"))
    with pytest.raises(ValueError, match="has 2 projections, got 1"):
        merge_lora(w, [pair], 1.0, FusedLayout("fc1"))
    with pytest.raises(ValueError, match=r"\(4, 3\) update for a \(5, 3\) weight"):
        merge_lora(torch.zeros(5, 3), [pair], 1.0)


# ------------------------------------------------------------------- against HF peft's merge
HEADS, KV_HEADS, HIDDEN, HEAD_DIM = 4, 2, 32, 8
RANK, ALPHA = 4, 8.0
ATTN = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj")


def _peft_model(targets: list[str]):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=64,
        max_position_embeddings=32,
    )
    base = LlamaForCausalLM(config)
    # init_lora_weights=False: B is random too, so every delta is non-zero.
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, init_lora_weights=False)
    return get_peft_model(base, lora)


def _ours(model, layer: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """projection -> (base weight, weight merged by `merge_lora` on megatron's fused layout) of
    one layer of the (not yet merged) `peft` model."""
    attn = model.base_model.model.model.layers[layer].self_attn
    mlp = model.base_model.model.model.layers[layer].mlp

    def base(module) -> torch.Tensor:
        return getattr(module, "base_layer", module).weight.detach().clone()

    def pair(module):
        if not hasattr(module, "lora_A"):
            return None
        return module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach()

    scale = ALPHA / RANK
    merged: dict[str, torch.Tensor] = {}
    mods = [getattr(attn, n) for n in ATTN]
    qkv = fuse_qkv(*(base(m) for m in mods), heads=HEADS, groups=KV_HEADS)
    layout = FusedLayout("qkv", KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    qkv = merge_lora(qkv, [pair(m) for m in mods], scale, layout)
    merged.update(zip(ATTN, split_qkv(qkv, HEADS, KV_HEADS, HEAD_DIM), strict=True))
    mods = [getattr(mlp, n) for n in MLP]
    fc1 = fuse_fc1(*(base(m) for m in mods))
    fc1 = merge_lora(fc1, [pair(m) for m in mods], scale, FusedLayout("fc1"))
    merged.update(zip(MLP, split_fc1(fc1), strict=True))
    for name, module in (("o_proj", attn.o_proj), ("down_proj", mlp.down_proj)):
        p = pair(module)
        merged[name] = base(module) if p is None else merge_lora(base(module), [p], scale)
    bases = {n: base(getattr(attn if n in (*ATTN, "o_proj") else mlp, n)) for n in merged}
    return {n: (bases[n], merged[n]) for n in merged}


@pytest.mark.parametrize(
    "targets",
    [[*ATTN, "o_proj", *MLP, "down_proj"], ["q_proj", "v_proj", "up_proj", "o_proj"]],
    ids=["all", "partial"],
)
def test_equals_peft_merge_and_unload(targets):
    model = _peft_model(targets)
    ours = [_ours(model, i) for i in range(2)]
    plain = model.merge_and_unload()
    worst = 0.0
    for i, layer in enumerate(plain.model.layers):
        for name, (base, merged) in ours[i].items():
            theirs = getattr(layer.self_attn if name in (*ATTN, "o_proj") else layer.mlp, name)
            worst = max(worst, (merged - theirs.weight).abs().max().item())
            if name in targets:  # not vacuous: the adapter moved the weight
                assert (merged - base).abs().max().item() > 1e-2, name
            else:  # a projection without an adapter keeps its base rows bit for bit
                assert torch.equal(merged, base), name
    print(f"max |ours - peft merge_and_unload| = {worst:.2e}")
    assert worst <= 1e-6, worst
