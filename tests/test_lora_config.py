"""`model.peft.*` is checked before any model exists: one line naming the key for every bad
value, NeMo's and Hugging Face's target names resolve to the projections they stand for, and
the reference policy defaults to the adapters-off model under LoRA, holding a frozen copy of
the starting adapter when that is not zero (`model.peft.reference=start`).

A starting adapter (adapter directories written by `peft` itself) is read as `peft` reads it:
`target_modules` as a list of names or one regular expression, `layers_to_transform` as a list
or one index; its rank, alpha, targets, layers and dropout fill the unset `lora_tuning` keys,
and stated values that differ are refused in one line naming them all, in the keys' own terms
(1-based layers). `model.peft.lora_tuning.target_modules` takes peft's string form too."""

from __future__ import annotations

import pytest
from hf_tiny import make_peft_adapter
from omegaconf import OmegaConf

from megatron_kto.config.errors import ConfigError
from megatron_kto.config.schema import ModelConfig
from megatron_kto.peft.adapter_config import adapter_values, read_adapter_config
from megatron_kto.peft.settings import (
    check_peft,
    lora_settings,
    reference_includes_starting_adapter,
    reference_strategy,
    resolve_lora_tuning,
    targets_and_layers,
)
from megatron_kto.peft.targets import DEFAULT_TARGET_MODULES, resolve_targets, selected_layers

WHERE = "model.peft.restore_from_path=adapter"


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
    assert reference_includes_starting_adapter(_model(adapter))
    assert not reference_includes_starting_adapter(_model(adapter, "peft.reference=base"))
    assert not reference_includes_starting_adapter(_model())  # B = 0: the start is the base
    both = [
        "peft.lora_tuning.column_init_method=kaiming",
        "peft.lora_tuning.row_init_method=normal",
    ]
    assert reference_includes_starting_adapter(_model(*both))
    assert not reference_includes_starting_adapter(_model(*both, "peft.reference=base"))
    assert not reference_includes_starting_adapter(_model(*both, "peft.peft_scheme=none"))


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


def _adapter(tmp_path, name: str = "adapter", **lora) -> dict:
    """adapter_config.json of an adapter `peft` wrote for a 4-layer Llama (as `_model()`)."""
    return read_adapter_config(make_peft_adapter(tmp_path / name, 4, **lora))


def _lora(**changes):
    from megatron_kto.peft.wiring import LoRASettings

    return LoRASettings(**{"rank": 8, "alpha": 8.0, "target_modules": ["q_proj"], **changes})


def test_a_regex_target_is_matched_as_peft_matches_it(tmp_path):
    """peft's `target_modules` may be one string: a regular expression that must match a whole
    module name. The run's check used to compare its sorted characters with the targets."""
    from megatron_kto.peft.hf_peft import check_matches

    regex = _adapter(tmp_path, target_modules=r".*\.(q_proj|v_proj)")
    assert isinstance(regex["target_modules"], str)
    values = adapter_values(regex, _model())
    assert (values["target_modules"], values["layer_selection"]) == (["q_proj", "v_proj"], None)
    check_matches(regex, _lora(target_modules=["q_proj", "v_proj"]), _model(), WHERE)
    some = _adapter(tmp_path, "some", target_modules=r"model\.layers\.[23]\.self_attn\.o_proj")
    values = adapter_values(some, _model())
    assert (values["target_modules"], values["layer_selection"]) == (["o_proj"], [3, 4])


def test_a_regex_that_selects_nothing_or_an_uneven_set_is_quoted_whole():
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "target_modules": "q_proj"}
    with pytest.raises(ValueError, match=r"^target_modules 'q_proj' selects none of this model"):
        adapter_values(config, _model())  # fullmatch: 'q_proj' is no module's whole name
    uneven = r"model\.layers\.0\.self_attn\.q_proj|model\.layers\.1\.self_attn\.v_proj"
    with pytest.raises(ValueError) as info:
        adapter_values({**config, "target_modules": uneven}, _model())
    text = str(info.value)
    assert "different projections in different layers (layer 1: q_proj; layer 2: v_proj)" in text


def test_a_layer_mismatch_is_reported_in_the_keys_1_based_numbers(tmp_path):
    from megatron_kto.peft.hf_peft import AdapterError, check_matches

    config = _adapter(tmp_path, target_modules=["q_proj"], layers_to_transform=[0, 1])
    with pytest.raises(AdapterError) as info:
        check_matches(config, _lora(layer_selection=[3, 4]), _model(), WHERE)
    text = str(info.value)
    assert text.startswith("model.peft.lora_tuning.layer_selection=[3, 4]: ") and "\n" not in text
    assert f"adapter {WHERE} has layer_selection=[1, 2];" in text


def test_an_equivalent_layers_to_transform_is_accepted(tmp_path):
    """peft's 0-based `layers_to_transform`, as one index or a list, against NeMo's 1-based
    `layer_selection`; every layer listed is the same as no selection."""
    from megatron_kto.peft.hf_peft import check_matches

    one = _adapter(tmp_path, "one", target_modules=["q_proj"], layers_to_transform=2)
    check_matches(one, _lora(layer_selection=[3]), _model(), WHERE)
    every = _adapter(tmp_path, "every", target_modules=["q_proj"], layers_to_transform=[3, 2, 1, 0])
    check_matches(every, _lora(layer_selection=None), _model(), WHERE)
    assert adapter_values(every, _model())["layer_selection"] is None


def test_the_target_default_is_defined_once():
    from megatron_kto.peft.wiring import LoRASettings

    assert OmegaConf.structured(ModelConfig).peft.lora_tuning.target_modules is None  # unset
    built_in = list(DEFAULT_TARGET_MODULES)
    assert lora_settings(_model()).target_modules == built_in
    assert LoRASettings(rank=1, alpha=1.0).target_modules == built_in


def test_init_methods_are_defined_once():
    from megatron_kto.peft import lora, settings

    assert lora.INIT_METHODS is settings.INIT_METHODS


def test_unset_keys_come_from_the_starting_adapter(tmp_path):
    adapter = _adapter(
        tmp_path,
        r=4,
        lora_alpha=16,
        lora_dropout=0.1,
        target_modules=["q_proj", "v_proj", "down_proj"],
        layers_to_transform=[1, 2],
    )
    m = _model("peft.restore_from_path=adapter")
    resolve_lora_tuning(m, m, adapter, WHERE)
    lt = m.peft.lora_tuning
    assert (lt.adapter_dim, lt.alpha, lt.adapter_dropout) == (4, 16.0, 0.1)
    assert (list(lt.target_modules), list(lt.layer_selection)) == (
        ["down_proj", "q_proj", "v_proj"], [2, 3],
    )  # fmt: skip
    check_peft(m, "kto", m)
    s = lora_settings(m)
    assert (s.rank, s.alpha, s.dropout, s.layer_selection) == (4, 16.0, 0.1, [2, 3])
    # Stated values that agree, in other spellings, are accepted; a stated dropout wins.
    agree = _model(
        "peft.lora_tuning.adapter_dim=4",
        "peft.lora_tuning.target_modules=[mlp_fc2,q_proj,v_proj]",
        "peft.lora_tuning.layer_selection=[3,2]",
        "peft.lora_tuning.adapter_dropout=0.0",
    )
    resolve_lora_tuning(agree, agree, adapter, WHERE)
    assert (agree.peft.lora_tuning.alpha, agree.peft.lora_tuning.adapter_dropout) == (16.0, 0.0)


def test_stated_values_that_contradict_the_adapter_are_refused_at_once(tmp_path):
    adapter = _adapter(tmp_path, r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    m = _model(
        "peft.lora_tuning.adapter_dim=8",
        "peft.lora_tuning.alpha=4",
        "peft.lora_tuning.target_modules=[attention]",
        "peft.lora_tuning.layer_selection=[1,2,3,4]",  # every layer: as the adapter
        "peft.lora_tuning.adapter_dropout=0.2",  # a training choice, not compared
    )
    with pytest.raises(ConfigError) as info:
        resolve_lora_tuning(m, m, adapter, WHERE)
    text = str(info.value)
    assert "\n" not in text and text.startswith(
        "model.peft.lora_tuning.adapter_dim=8, model.peft.lora_tuning.alpha=4.0, "
        "model.peft.lora_tuning.target_modules=['attention']: the starting adapter "
        f"{WHERE} has adapter_dim=4, alpha=16.0, target_modules=['q_proj', 'v_proj']; "
    ), text


def test_without_an_adapter_unset_keys_take_the_built_in_defaults():
    m = _model()
    resolve_lora_tuning(m, m)
    lt = m.peft.lora_tuning
    assert (lt.adapter_dim, lt.alpha, lt.adapter_dropout, lt.layer_selection) == (
        32, None, 0.0, None,
    )  # fmt: skip
    assert list(lt.target_modules) == list(DEFAULT_TARGET_MODULES)


def test_a_regex_target_in_the_config_means_what_it_means_to_peft():
    m = _model()
    m.peft.lora_tuning.target_modules = r"model\.layers\.[12]\.self_attn\.(q_proj|v_proj)"
    assert targets_and_layers(m, m) == (["q_proj", "v_proj"], [2, 3])
    check_peft(m, "kto", m)
    s = lora_settings(m)
    assert (s.target_modules, s.layer_selection) == (["q_proj", "v_proj"], [2, 3])
    resolve_lora_tuning(m, m)  # written back as the projections and layers it selects
    assert (list(m.peft.lora_tuning.target_modules), list(m.peft.lora_tuning.layer_selection)) == (
        ["q_proj", "v_proj"], [2, 3],
    )  # fmt: skip


@pytest.mark.parametrize(
    "targets,layers,message",
    [
        (
            "q_proj",  # a whole-name match: no module is called just q_proj
            None,
            "model.peft.lora_tuning.target_modules: 'q_proj' selects none of this model's",
        ),
        (".*(q_proj", None, "model.peft.lora_tuning.target_modules: '.*(q_proj' is not a valid"),
        (".*q_proj", [1], "model.peft.lora_tuning.layer_selection: not with a regular-expression"),
        (5, None, "model.peft.lora_tuning.target_modules: must be a list of names or one regular"),
    ],
)
def test_bad_target_strings_are_quoted_whole(targets, layers, message):
    m = _model()
    m.peft.lora_tuning.target_modules, m.peft.lora_tuning.layer_selection = targets, layers
    with pytest.raises(ConfigError) as info:
        check_peft(m, "kto", m)
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text and "['" not in text, text


def test_an_adapter_of_another_peft_method_is_refused_before_any_model(tmp_path):
    adapter = make_peft_adapter(tmp_path / "dora", 4, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(ValueError, match=r"adapter_config.json: use_dora=True is not supported$"):
        read_adapter_config(adapter)
