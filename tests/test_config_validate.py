"""Config composition (YAML + typed schema) and the cross-field checks, without building anything.

Configs are composed exactly as the entry scripts compose them (Hydra, `conf/`, the registered
schema), so these tests also cover the shipped YAML files and model presets.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from megatron_kto.config.schema import architecture_of, register
from megatron_kto.config.validate import ConfigError, data_parallel_size, validate

CONF = str(Path(__file__).resolve().parents[1] / "conf")
register()


def _compose(name: str, overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name=name, overrides=overrides or [])


@pytest.mark.parametrize("name,algorithm", [("gpt_kto", "kto"), ("gpt_dpo", "dpo")])
def test_shipped_configs_validate_on_one_and_two_ranks(name, algorithm):
    cfg = _compose(name)
    for world in (1, 2):
        validate(cfg, world, algorithm)


@pytest.mark.parametrize(
    "preset", ["tiny", "llama3_8b", "llama3_2_1b", "mistral_7b", "qwen2_0_5b", "qwen2_7b"]
)
def test_model_presets_compose_to_architectures(preset):
    arch = architecture_of(_compose("gpt_kto", [f"model={preset}"]).model)
    assert arch.hidden_size % arch.num_attention_heads == 0
    if arch.num_query_groups is not None:
        assert arch.num_attention_heads % arch.num_query_groups == 0


def test_presets_carry_the_family_options():
    """The shapes that make each family what it is (public model configs)."""
    llama = architecture_of(_compose("gpt_kto", ["model=llama3_8b"]).model)
    assert (llama.num_layers, llama.hidden_size, llama.num_attention_heads) == (32, 4096, 32)
    assert llama.num_query_groups == 8 and llama.rotary_base == 500000
    qwen = architecture_of(_compose("gpt_kto", ["model=qwen2_0_5b"]).model)
    assert qwen.add_qkv_bias and qwen.share_embeddings_and_output_weights
    mistral = architecture_of(_compose("gpt_kto", ["model=mistral_7b"]).model)
    assert mistral.num_query_groups == 8 and not mistral.add_qkv_bias


@pytest.mark.parametrize(
    "override",
    ["model.kto.ref_policy_klpenalty=0.2", "trainer.kto.max_step=3", "modle.seed=1"],
)
def test_typo_in_a_key_fails_at_composition(override):
    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        _compose("gpt_kto", [override])


def test_wrong_type_fails_at_composition():
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose("gpt_kto", ["model.micro_batch_size=four"])


@pytest.mark.parametrize(
    "overrides,world,key",
    [
        (["model.global_batch_size=18"], 2, "model.global_batch_size"),
        (["model.tensor_model_parallel_size=3"], 2, "model.tensor_model_parallel_size"),
        (["model.tensor_model_parallel_size=8"], 8, "model.num_attention_heads"),
        (["model.pipeline_model_parallel_size=2", "model.num_layers=3"], 2, "model.num_layers"),
        (["model.kto.loss_type=sigmoid"], 1, "model.kto.loss_type"),
        (["model.kto.reference_policy=gpu"], 1, "model.kto.reference_policy"),
        (["model.kto.ref_policy_kl_penalty=0"], 1, "model.kto.ref_policy_kl_penalty"),
        (["model.global_batch_size=1", "model.micro_batch_size=1"], 1, "model.global_batch_size"),
        (
            ["model.kto.log_prob_forward_micro_batch_size=3"],
            1,
            "model.kto.log_prob_forward_micro_batch_size",
        ),
        (["model.logprob_chunk_size=-1"], 1, "model.logprob_chunk_size"),
        (["trainer.precision=16"], 1, "trainer.precision"),
        (["trainer.devices=4"], 2, "trainer.devices"),
        (["model.data.truncation_mode=middle"], 1, "model.data.truncation_mode"),
        (
            [
                "model.pipeline_model_parallel_size=2",
                "model.virtual_pipeline_model_parallel_size=2",
                "model.num_layers=4",
                "model.global_batch_size=3",
                "model.micro_batch_size=1",
            ],
            2,
            "model.global_batch_size",
        ),
        (
            [
                "model.pipeline_model_parallel_size=2",
                "model.virtual_pipeline_model_parallel_size=2",
                "model.num_layers=4",
                "model.global_batch_size=4",
                "model.micro_batch_size=1",
                "model.kto.log_prob_forward_micro_batch_size=4",
            ],
            2,
            "model.kto.log_prob_forward_micro_batch_size",
        ),
    ],
)
def test_impossible_combinations_name_the_key(overrides, world, key):
    cfg = _compose("gpt_kto", overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg, world, "kto")
    message = str(info.value)
    assert message.startswith(f"{key}:"), message
    assert "\n" not in message


def test_one_row_per_rank_is_allowed():
    """KL partners come from the global batch, so a data-parallel share of one row is fine."""
    cfg = _compose("gpt_kto", ["model.global_batch_size=2", "model.micro_batch_size=1"])
    validate(cfg, 2, "kto")


def test_data_parallel_size():
    cfg = _compose("gpt_kto", ["model.tensor_model_parallel_size=2"])
    assert data_parallel_size(cfg, 8) == 4
    with pytest.raises(ConfigError, match="^model.tensor_model_parallel_size:"):
        data_parallel_size(cfg, 3)


def test_dpo_label_smoothing_range():
    cfg = _compose("gpt_dpo", ["model.dpo.label_smoothing=0.5"])
    with pytest.raises(ConfigError, match="^model.dpo.label_smoothing:"):
        validate(cfg, 1, "dpo")
