"""Config keys of the attention backend, sequence parallelism and activation recomputation.

Composed as the entry scripts compose them (Hydra, `conf/`, the schema) and checked by
`validate`, which must name the key; nothing is built.
"""

from __future__ import annotations

import pytest

from megatron_kto.config.entry import compose_run_config
from megatron_kto.config.validate import ConfigError, validate
from megatron_kto.runtime.gpu_settings import transformer_engine_available


def _compose(overrides: list[str], world: int = 1):
    """Composed and prepared as the entry script does it (the bundled example selects the tiny
    architecture; conf/gpt_kto.yaml alone names none), validated for `world` ranks."""
    return compose_run_config(
        "gpt_kto", ["example=tiny_kto", *overrides], "kto", world_size=world
    ).cfg


@pytest.mark.parametrize(
    "overrides,world",
    [
        (["model.attention_backend=sdpa"], 1),
        (["model.attention_backend=local", "model.data.pack_sequences=false"], 1),
        (["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"], 2),
        (["model.activations_checkpoint_granularity=selective"], 1),
        (["model.activations_checkpoint_granularity=full"], 1),
        (
            [
                "model.activations_checkpoint_granularity=full",
                "model.activations_checkpoint_method=block",
                "model.activations_checkpoint_num_layers=2",
            ],
            1,
        ),
        (
            [
                "model.num_layers=4",
                "model.pipeline_model_parallel_size=2",
                "model.activations_checkpoint_granularity=full",
                "model.activations_checkpoint_method=uniform",
                "model.activations_checkpoint_num_layers=2",
            ],
            2,
        ),
    ],
)
def test_valid_settings_pass(overrides, world):
    validate(_compose(overrides, world), world, "kto")


def test_default_backend_is_auto():
    assert _compose([]).model.attention_backend == "auto"
    validate(_compose([]), 1, "kto")


def test_packing_is_on_by_default():
    assert _compose([]).model.data.pack_sequences is True
    assert _compose(["model.data.pack_sequences=false"]).model.data.pack_sequences is False


@pytest.mark.parametrize(
    "overrides,world,key,fragment",
    [
        (["model.attention_backend=flash"], 1, "model.attention_backend", "must be one of"),
        (
            ["model.attention_backend=local"],
            1,
            "model.data.pack_sequences",
            "model.attention_backend=local (megatron's unfused attention) cannot take them",
        ),
        (["model.sequence_parallel=true"], 1, "model.sequence_parallel", "tensor_model_parallel"),
        (
            ["model.activations_checkpoint_granularity=partial"],
            1,
            "model.activations_checkpoint_granularity",
            "must be one of",
        ),
        (
            [
                "model.activations_checkpoint_granularity=full",
                "model.activations_checkpoint_method=random",
            ],
            1,
            "model.activations_checkpoint_method",
            "must be one of",
        ),
        (
            [
                "model.activations_checkpoint_granularity=selective",
                "model.activations_checkpoint_num_layers=1",
            ],
            1,
            "model.activations_checkpoint_num_layers",
            "only applies to activations_checkpoint_granularity=full",
        ),
        (
            ["model.activations_checkpoint_method=uniform"],
            1,
            "model.activations_checkpoint_method",
            "only applies",
        ),
        (
            [
                "model.activations_checkpoint_granularity=full",
                "model.activations_checkpoint_num_layers=3",
            ],
            1,
            "model.activations_checkpoint_num_layers",
            "between 1 and the 2 layers",
        ),
        (
            [
                "model.num_layers=6",
                "model.activations_checkpoint_granularity=full",
                "model.activations_checkpoint_num_layers=4",
            ],
            1,
            "model.activations_checkpoint_num_layers",
            "must divide the 6 layers",
        ),
        (
            [
                "model.num_layers=4",
                "model.pipeline_model_parallel_size=2",
                "model.activations_checkpoint_granularity=full",
                "model.activations_checkpoint_method=block",
                "model.activations_checkpoint_num_layers=3",
            ],
            2,
            "model.activations_checkpoint_num_layers",
            "between 1 and the 2 layers",
        ),
    ],
)
def test_invalid_settings_name_the_key(overrides, world, key, fragment):
    with pytest.raises(ConfigError) as err:
        _compose(overrides, world)
    message = str(err.value)
    assert message.startswith(f"{key}: "), message
    assert fragment in message, message


def test_te_backend_needs_transformer_engine():
    if transformer_engine_available():
        validate(_compose(["model.attention_backend=te"]), 1, "kto")
        return
    with pytest.raises(ConfigError, match=r"^model\.attention_backend: 'te' needs Transformer"):
        _compose(["model.attention_backend=te"])
