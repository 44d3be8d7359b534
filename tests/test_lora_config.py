"""`model.peft.*` is checked before any model exists: one line naming the key for every bad
value, NeMo's and Hugging Face's target names resolve to the projections they stand for, and
the reference policy defaults to the adapters-off model under LoRA, holding a frozen copy of
the starting adapter when that is not zero (`model.peft.reference=start`)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from megatron_kto.config.errors import ConfigError
from megatron_kto.config.schema import ModelConfig
from megatron_kto.peft.settings import (
    check_peft,
    holds_starting_adapter,
    lora_settings,
    reference_strategy,
)
from megatron_kto.peft.targets import resolve_targets, selected_layers


def _model(*overrides: str, activation: str = "swiglu"):
    m = OmegaConf.structured(ModelConfig)
    m.num_layers, m.activation = 4, activation
    return OmegaConf.merge(m, OmegaConf.from_dotlist(["peft.peft_scheme=lora", *overrides]))


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "peft.lora_tuning.adapter_dim=0",
            "model.peft.lora_tuning.adapter_dim: must be a positive",
        ),
        ("peft.lora_tuning.alpha=-1", "model.peft.lora_tuning.alpha: must be > 0"),
        ("peft.lora_tuning.adapter_dropout=1.0", "model.peft.lora_tuning.adapter_dropout: must be"),
        ("peft.lora_tuning.target_modules=[qkv]", "model.peft.lora_tuning.target_modules: unknown"),
        ("peft.lora_tuning.target_modules=[]", "model.peft.lora_tuning.target_modules: no target"),
        ("peft.lora_tuning.layer_selection=[0]", "model.peft.lora_tuning.layer_selection: layer"),
        ("peft.lora_tuning.layer_selection=[5]", "model.peft.lora_tuning.layer_selection: layer"),
        ("peft.lora_tuning.weight_tying=true", "model.peft.lora_tuning.weight_tying: not impl"),
        (
            "peft.lora_tuning.position_embedding_strategy=add",
            "model.peft.lora_tuning.position_embedding_strategy: not implemented",
        ),
        ("peft.lora_tuning.row_init_method=ones", "model.peft.lora_tuning.row_init_method: must"),
        ("peft.peft_scheme=ptuning", "model.peft.peft_scheme: must be one of ['none', 'lora']"),
        ("kto.reference_policy=cpu_swap", "model.kto.reference_policy: with model.peft.peft_sch"),
        ("peft.reference=initial", "model.peft.reference: must be one of ['start', 'base']"),
    ],
)
def test_bad_values_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as info:
        check_peft(_model(override), "kto", _model(override))
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text, text


def test_a_projection_the_architecture_lacks_is_refused():
    m = _model("peft.lora_tuning.target_modules=[gate_proj]", activation="gelu")
    with pytest.raises(ConfigError, match=r"^model.peft.lora_tuning.target_modules: 'gate_proj'"):
        check_peft(m, "kto", m)


def test_adapters_off_needs_lora():
    m = OmegaConf.merge(
        OmegaConf.structured(ModelConfig), {"dpo": {"reference_policy": "adapters_off"}}
    )
    with pytest.raises(ConfigError, match=r"^model.dpo.reference_policy: must be one of"):
        check_peft(m, "dpo", m)


def test_reference_defaults():
    assert reference_strategy(_model(), "kto") == "adapters_off"
    assert reference_strategy(_model(), "dpo") == "adapters_off"
    assert reference_strategy(OmegaConf.structured(ModelConfig), "kto") == "cpu_swap"
    assert reference_strategy(_model("kto.reference_policy=precomputed"), "kto") == "precomputed"


def test_frozen_starting_adapter_only_when_the_start_is_not_the_base():
    adapter = "peft.restore_from_path=/some/adapter"
    assert holds_starting_adapter(_model(adapter))
    assert not holds_starting_adapter(_model(adapter, "peft.reference=base"))
    assert not holds_starting_adapter(_model())  # B = 0: the start is the base
    both = [
        "peft.lora_tuning.column_init_method=kaiming",
        "peft.lora_tuning.row_init_method=normal",
    ]
    assert holds_starting_adapter(_model(*both))
    assert not holds_starting_adapter(_model(*both, "peft.reference=base"))
    assert not holds_starting_adapter(_model(*both, "peft.peft_scheme=none"))


def test_target_names():
    arch = _model()
    hf = resolve_targets(["q_proj", "v_proj", "down_proj"], arch)
    assert [(t.linear, t.projections) for t in hf] == [
        ("self_attention.linear_qkv", ("q_proj", "v_proj")),
        ("mlp.linear_fc2", ("down_proj",)),
    ]
    everything = resolve_targets(["all"], arch)
    assert [t.projections for t in everything] == [
        ("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",),
    ]  # fmt: skip
    assert resolve_targets(["attention", "mlp"], arch) == everything
    gelu = resolve_targets(["mlp_fc1"], _model(activation="gelu"))
    assert [t.projections for t in gelu] == [("up_proj",)]
    assert selected_layers([4, 1, 1], 4) == [0, 3] and selected_layers(None, 2) == [0, 1]


def test_settings_follow_nemo_defaults():
    s = lora_settings(_model())
    # NeMo-Aligner's stock block: attention_qkv, rank 32, alpha = rank (scaling 1), xavier / zero.
    assert (s.rank, s.alpha, s.target_modules, s.init_a, s.init_b) == (
        32, 32.0, ["attention_qkv"], "xavier", "zero",
    )  # fmt: skip


@pytest.mark.parametrize("targets", ["[all]", "[mlp]", "[attention,down_proj]", "[mlp_fc1]"])
def test_adapters_on_experts_are_refused_in_one_line(targets):
    m = _model(f"peft.lora_tuning.target_modules={targets}")
    m.num_moe_experts = 4
    with pytest.raises(ConfigError) as info:
        check_peft(m, "kto", m)
    text = str(info.value)
    assert text.startswith("model.peft.lora_tuning.target_modules: ") and "\n" not in text
    assert "experts take no adapters" in text and "target the attention only" in text


def test_attention_of_an_moe_model_is_accepted():
    m = _model("peft.lora_tuning.target_modules=[attention_qkv,attention_dense]")
    m.num_moe_experts = 4
    check_peft(m, "kto", m)
    assert [t.linear for t in resolve_targets(list(m.peft.lora_tuning.target_modules), m)] == [
        "self_attention.linear_qkv", "self_attention.linear_proj",
    ]  # fmt: skip
