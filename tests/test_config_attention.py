"""Config keys of the attention backend, sequence parallelism and activation recomputation.

Composed as the entry scripts compose them (Hydra, `conf/`, the schema) and checked by
`validate`, which must name the key; nothing is built. The machine is stated
(`Accelerator.detect` returns it), so every decision below is the same on any test machine.
"""

from __future__ import annotations

import pytest

from megatron_kto.config.validate import ConfigError, attention_choice, validate
from megatron_kto.entry import compose_run_config
from megatron_kto.runtime.gpu_settings import Accelerator

CPU = Accelerator(cuda=False)
TE_2_9 = Accelerator(cuda=True, transformer_engine="2.9.0")
TE_2_11 = Accelerator(cuda=True, transformer_engine="2.11.0")


def _state(monkeypatch, machine: Accelerator) -> None:
    monkeypatch.setattr(Accelerator, "detect", classmethod(lambda cls, read_device=False: machine))


@pytest.fixture(autouse=True)
def on_a_cpu(monkeypatch):
    """Every test runs on a stated CPU machine unless it states another."""
    _state(monkeypatch, CPU)


def _prepare(overrides: list[str], world: int = 1):
    """Composed and prepared as the entry script does it (the bundled example selects the tiny
    architecture; conf/gpt_kto.yaml alone names none), validated for `world` ranks."""
    return compose_run_config("gpt_kto", ["example=tiny_kto", *overrides], "kto", world_size=world)


def _compose(overrides: list[str], world: int = 1):
    return _prepare(overrides, world).cfg


@pytest.mark.parametrize(
    "overrides,world,backend",
    [
        (["model.attention_backend=sdpa"], 1, "sdpa"),
        (["model.attention_backend=local", "model.data.pack_sequences=false"], 1, "local"),
        (["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"], 2, "sdpa"),
        (["model.activations_checkpoint_granularity=selective"], 1, "sdpa"),
        (["model.activations_checkpoint_granularity=full"], 1, "sdpa"),
        (
            [
                "model.activations_checkpoint_granularity=full",
                "model.activations_checkpoint_method=block",
                "model.activations_checkpoint_num_layers=2",
            ],
            1,
            "sdpa",
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
            "sdpa",
        ),
    ],
)
def test_valid_settings_pass(overrides, world, backend):
    cfg = _compose(overrides, world)
    validate(cfg, world, "kto")
    assert attention_choice(cfg).backend == backend


def test_default_backend_is_auto_and_the_note_says_what_it_chose():
    prepared = _prepare([])
    assert prepared.cfg.model.attention_backend == "auto"
    assert "model.attention_backend=auto: sdpa (no CUDA device)" in prepared.notes


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
            "must divide the layers of each model chunk (6)",
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
    with pytest.raises(ConfigError) as err:
        _compose(["model.attention_backend=te"])
    assert str(err.value) == (
        "model.attention_backend: 'te' needs Transformer Engine and a CUDA device (no CUDA "
        "device); set model.attention_backend=auto or sdpa"
    )


def test_bundled_example_on_te_2_9_runs_sdpa(monkeypatch):
    """The issue's crash: the example (fp32, packed) on the NGC 25.11 image (TE 2.9) picked TE,
    which has no fp32 attention for packed input. `auto` now picks SDPA and says why."""
    _state(monkeypatch, TE_2_9)
    prepared = _prepare([])
    assert prepared.cfg.trainer.precision == "32" and prepared.cfg.model.data.pack_sequences
    assert (
        "model.attention_backend=auto: sdpa (Transformer Engine 2.9.0: its flash and fused "
        "attention need bf16 or fp16, its unfused attention takes packed (THD) input only from "
        "2.11.0)"
    ) in prepared.notes
    assert attention_choice(_compose(["trainer.precision=bf16"])).backend == "te"


def test_explicit_te_in_fp32_with_packing_on_te_2_9_is_one_error_line(monkeypatch):
    _state(monkeypatch, TE_2_9)
    with pytest.raises(ConfigError) as err:
        _compose(["model.attention_backend=te"])
    assert str(err.value) == (
        "model.attention_backend: 'te' cannot run fp32 + packed sequences (Transformer Engine "
        "2.9.0: its flash and fused attention need bf16 or fp16, its unfused attention takes "
        "packed (THD) input only from 2.11.0); set model.attention_backend=sdpa (or auto), "
        "trainer.precision=bf16, or model.data.pack_sequences=false"
    )
    # Each of the fixes the message offers is accepted.
    for fix in (
        "model.attention_backend=sdpa",
        "trainer.precision=bf16",
        "model.data.pack_sequences=false",
    ):
        overrides = ["model.attention_backend=te", fix]
        if fix.startswith("model.attention_backend"):
            overrides = [fix]
        want = "sdpa" if fix.endswith("sdpa") else "te"
        assert attention_choice(_compose(overrides)).backend == want, fix


def test_explicit_te_in_fp32_with_packing_runs_on_te_2_11(monkeypatch):
    _state(monkeypatch, TE_2_11)
    cfg = _compose(["model.attention_backend=te"])
    assert attention_choice(cfg).backend == "te"
    assert attention_choice(_compose([])).backend == "sdpa"  # auto keeps SDPA in fp32


def test_the_start_up_check_and_the_builder_read_the_same_attention_features(monkeypatch):
    """One `AttentionFeatures` for every caller: composed with a sliding window, attention
    dropout and gated DeltaNet layers, the config's features are the architecture's, and the
    start-up check (from the config) and the model builder (from the `GPTArchitecture`) decide
    alike. On TE 2.9 without flash-attn a window with dropout has no fused kernel, so bf16 `auto`
    keeps SDPA (it would be TE without the dropout), and both name the DeltaNet kernels."""
    import dataclasses

    from megatron_kto.config.schema import architecture_of
    from megatron_kto.models import builder
    from megatron_kto.runtime.attention_backend import AttentionFeatures

    _state(monkeypatch, TE_2_9)
    cfg = _compose(
        [
            "trainer.precision=bf16",
            "model.sliding_window=8",
            "model.attention_dropout=0.1",
            "model.linear_attention_freq=[1,0]",
        ]
    )
    arch = architecture_of(cfg.model)
    features = AttentionFeatures.of(arch)
    assert features == AttentionFeatures(
        head_dim=16, sliding_window=True, attention_dropout=0.1, linear_attention=True
    )
    at_start = attention_choice(cfg)
    assert at_start.backend == "sdpa" and "without attention dropout" in at_start.reason
    assert at_start.deltanet == "torch" and "fla is not installed" in at_start.deltanet_reason
    layout = builder.ParallelLayout(precision="bf16", pack_sequences=True)
    assert builder.attention_choice(arch, layout) == at_start
    arch.attention_dropout = 0.0
    assert AttentionFeatures.of(arch) == dataclasses.replace(features, attention_dropout=0.0)
    assert builder.attention_choice(arch, layout).backend == "te"
