"""Hybrid (gated DeltaNet) architectures in the run config: impossible or unfinished
combinations fail before any model is built, in one line naming the key."""

from __future__ import annotations

import pytest

from megatron_kto.config.schema import register
from megatron_kto.config.validate import ConfigError
from megatron_kto.entry import compose_run_config

register()

HYBRID = [
    "model.linear_attention_freq=[1,0]",
    "model.linear_num_key_heads=2",
    "model.linear_num_value_heads=4",
    "model.linear_key_head_dim=8",
    "model.linear_value_head_dim=8",
    "model.attention_output_gate=true",
]


def test_a_hybrid_tiny_model_validates():
    compose_run_config("gpt_kto", HYBRID, "kto", world_size=2)
    lora = ["model.peft.peft_scheme=lora", "model.peft.lora_tuning.target_modules=[all]"]
    compose_run_config("gpt_kto", HYBRID + lora, "kto", world_size=2)


@pytest.mark.parametrize(
    "overrides,world,match",
    [
        (
            ["model.context_parallel_size=2"],
            2,
            r"^model.context_parallel_size: 2: gated DeltaNet layers \[0\]",
        ),
        (
            [
                "model.tensor_model_parallel_size=2",
                "model.linear_num_key_heads=1",
                "model.linear_num_value_heads=2",
            ],
            2,
            r"^model.tensor_model_parallel_size: 2 must divide the gated DeltaNet heads",
        ),
        (
            ["model.linear_num_value_heads=3"],
            1,
            r"^model.linear_num_value_heads: 3 is not a multiple",
        ),
        (["model.linear_attention_freq=[1,0,1]"], 1, r"^model.linear_attention_freq: \[1, 0, 1\]"),
        (["model.linear_in_proj=qkvz"], 1, r"^model.linear_in_proj: 'qkvz' is not one of"),
    ],
)
def test_unfinished_or_impossible_combinations_are_one_line(overrides, world, match):
    with pytest.raises(ConfigError, match=match) as e:
        compose_run_config("gpt_kto", HYBRID + overrides, "kto", world_size=world)
    assert "\n" not in str(e.value)
