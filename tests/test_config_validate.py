"""Config composition (YAML + typed schema) and the cross-field checks, without building anything.

Configs are composed exactly as the entry scripts compose them (Hydra, `conf/`, the registered
schema, the bundled example when no data and no checkpoint are given), so these tests also
cover the shipped YAML files and model presets.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from megatron_kto.config.schema import architecture_of, register
from megatron_kto.config.validate import ConfigError, data_parallel_size, validate
from megatron_kto.entry import compose_run_config
from megatron_kto.runtime.gpu_settings import Accelerator

CONF = str(Path(__file__).resolve().parents[1] / "conf")
register()


def _compose(name: str, overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name=name, overrides=overrides or [])


@pytest.mark.parametrize("name,algorithm", [("gpt_kto", "kto"), ("gpt_dpo", "dpo")])
def test_shipped_configs_validate_on_one_and_two_ranks(name, algorithm):
    """With no overrides the shipped configs are the bundled tiny examples, and say so."""
    for world in (1, 2):
        prepared = compose_run_config(name, [], algorithm, world_size=world)
        validate(prepared.cfg, world, algorithm)
        assert any(f"conf/example/tiny_{algorithm}.yaml" in n for n in prepared.notes)


@pytest.mark.parametrize(
    "preset",
    ["tiny", "llama3_8b", "llama3_2_1b", "mistral_7b", "qwen2_0_5b", "qwen2_7b", "gemma3_1b"],
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
    assert mistral.sliding_window == 4096 and mistral.window_layers is None
    gemma = architecture_of(_compose("gpt_kto", ["model=gemma3_1b"]).model)
    assert gemma.window_layers[:6] == [1, 1, 1, 1, 1, 0] and len(gemma.window_layers) == 26
    assert gemma.post_norms and gemma.zero_centered_norms and gemma.activation == "geglu"


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
        (["trainer.precision=16-true"], 1, "trainer.precision"),
        (["model.logprob_chunk_size=-1"], 1, "model.logprob_chunk_size"),
        (["trainer.devices=4"], 2, "trainer.devices"),
        (["trainer.distributed_timeout_minutes=0"], 1, "trainer.distributed_timeout_minutes"),
        (["trainer.non_finite=ignore"], 1, "trainer.non_finite"),
        (["model.data.truncation_mode=middle"], 1, "model.data.truncation_mode"),
        (["model.moe_layer_freq=[1,0]"], 1, "model.moe_layer_freq"),  # a dense model
        (["model.num_moe_experts=4", "model.moe_layer_freq=[1,0,1]"], 1, "model.moe_layer_freq"),
        (["model.num_moe_experts=4", "model.moe_layer_freq=[0,0]"], 1, "model.moe_layer_freq"),
        (["model.num_moe_experts=4", "model.moe_layer_freq=[2,1]"], 1, "model.moe_layer_freq"),
        (["model.moe_router_score_function=top1"], 1, "model.moe_router_score_function"),
        (
            ["model.num_moe_experts=4", "model.moe_router_enable_expert_bias=true"],
            1,
            "model.moe_router_enable_expert_bias",
        ),
        (["model.moe_router_bias_update_rate=0.01"], 1, "model.moe_router_bias_update_rate"),
        (
            [
                "model.num_moe_experts=4",
                "model.moe_router_score_function=sigmoid",
                "model.moe_router_enable_expert_bias=true",
                "model.moe_router_bias_update_rate=0.01",
                "model.peft.peft_scheme=lora",
            ],
            1,
            "model.moe_router_bias_update_rate",
        ),
        (
            [
                "model.num_moe_experts=4",
                "model.moe_router_score_function=sigmoid",
                "model.moe_aux_loss_coeff=0.01",
            ],
            1,
            "model.moe_aux_loss_coeff",
        ),
        (
            ["model.num_moe_experts=4", "model.moe_router_num_groups=3"],
            1,
            "model.moe_router_group_topk",
        ),
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
    with pytest.raises(ConfigError) as info:
        compose_run_config("gpt_kto", overrides, "kto", world_size=world)
    message = str(info.value)
    assert message.startswith(f"{key}:"), message
    assert "\n" not in message


def test_one_row_per_rank_is_allowed():
    """KL partners come from the global batch, so a data-parallel share of one row is fine."""
    compose_run_config(
        "gpt_kto", ["model.global_batch_size=2", "model.micro_batch_size=1"], world_size=2
    )


def test_data_parallel_size():
    cfg = _compose("gpt_kto", ["model.tensor_model_parallel_size=2"])
    assert data_parallel_size(cfg, 8) == 4
    with pytest.raises(ConfigError, match="^model.tensor_model_parallel_size:"):
        data_parallel_size(cfg, 3)


def test_dpo_label_smoothing_range():
    with pytest.raises(ConfigError, match="^model.dpo.label_smoothing:"):
        compose_run_config("gpt_dpo", ["model.dpo.label_smoothing=0.5"], "dpo")


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["model.dpo.loss_type=bco"], "loss_type"),
        (["model.dpo.loss_type=[sigmoid,aot_paired]"], "loss_type"),
        (["model.dpo.loss_type=[sigmoid,sft]", "model.dpo.loss_weights=[1.0]"], "loss_weights"),
        (["model.dpo.loss_type=exo_pair"], "label_smoothing"),
        (["model.dpo.loss_type=apo_zero", "model.dpo.label_smoothing=0.1"], "label_smoothing"),
        (["model.dpo.loss_type=discopop", "model.dpo.discopop_tau=0"], "discopop_tau"),
    ],
)
def test_dpo_loss_catalogue_refusals_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"^model.dpo.{key}: ") as e:
        compose_run_config("gpt_dpo", overrides, "dpo")
    assert "\n" not in str(e.value)
    if key == "loss_type":
        assert "supported: sigmoid, ipo, hinge, exo_pair, nca_pair, robust" in str(e.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.dpo.loss_type=robust", "model.dpo.label_smoothing=0.1"],
        ["model.dpo.loss_type=exo_pair", "model.dpo.label_smoothing=1e-3"],
        ["model.dpo.loss_type=discopop", "model.dpo.discopop_tau=0.1"],
        ["model.dpo.loss_type=[sigmoid,sft]", "model.dpo.loss_weights=[1.0,0.5]"],
        ["model.dpo.loss_type=[sigmoid_norm,apo_zero,sppo_hard,nca_pair,apo_down]"],
    ],
)
def test_dpo_loss_catalogue_accepted(overrides):
    prepared = compose_run_config("gpt_dpo", overrides, "dpo")
    validate(prepared.cfg, 1, "dpo")


# ------------------------------------------------------------ demo values vs real-run defaults

REPO = Path(__file__).resolve().parents[1]
SP = str(REPO / "examples" / "data" / "tokenizer" / "tiny_sp.model")
TRAIN = str(REPO / "examples" / "data" / "tiny_kto" / "train.jsonl")
#: A run from scratch on the user's data (a preset gives the shape; no checkpoint).
REAL = ["model=tiny", f"model.data.data_prefix.train=[{TRAIN}]", f"model.tokenizer.model={SP}"]


def _state(monkeypatch, machine: Accelerator) -> None:
    monkeypatch.setattr(Accelerator, "detect", classmethod(lambda cls, read_device=False: machine))


def test_demo_values_do_not_leak_into_a_run_given_data(monkeypatch):
    """Naming training data is a real run: the schema's defaults apply, not the example's."""
    _state(monkeypatch, Accelerator(cuda=True, transformer_engine="2.9.0"))
    prepared = compose_run_config("gpt_kto", REAL)
    cfg = prepared.cfg
    assert not any("bundled tiny example" in n for n in prepared.notes)
    assert cfg.model.optim.lr == 5e-6 and cfg.model.optim.sched.min_lr == pytest.approx(5e-7)
    assert cfg.model.data.max_length is None  # the model's own position limit
    assert cfg.trainer.kto.max_steps == -1 and cfg.trainer.kto.val_check_interval == 0.1
    assert cfg.trainer.precision == "bf16"  # unset: follows the (stated CUDA) device
    assert (cfg.model.global_batch_size, cfg.model.micro_batch_size) == (64, 1)
    assert cfg.model.tokenizer.library == "sentencepiece"  # inferred from the .model file
    demo = compose_run_config("gpt_kto", []).cfg
    assert demo.model.optim.lr == 1e-3 and demo.model.data.max_length == 64


def test_a_real_run_needs_an_architecture():
    """Without a checkpoint or a preset nothing defines the model: no silent tiny default."""
    with pytest.raises(ConfigError, match=r"^model.num_layers: no model architecture: set "):
        compose_run_config("gpt_kto", REAL[1:])


@pytest.mark.parametrize("extra", [[], ["example=tiny_kto"]])
def test_lr_alone_is_enough(extra):
    """`model.optim.lr=5e-6` alone: min_lr follows it (lr / 10), in a real run and the demo."""
    for base in (REAL, []):
        cfg = compose_run_config("gpt_kto", [*base, *extra, "model.optim.lr=5e-6"]).cfg
        assert cfg.model.optim.sched.min_lr == pytest.approx(5e-7)


@pytest.mark.parametrize(
    "overrides,key,fragment",
    [
        (["model.optim.sched.min_lr=1e-4", "model.optim.lr=5e-6"], "model.optim.sched.min_lr",
         "0.0001 is above model.optim.lr 5e-06"),
        (["model.optim.sched.min_lr=-1.0"], "model.optim.sched.min_lr", "must be >= 0"),
        (["model.optim.weight_decay=-0.1"], "model.optim.weight_decay", "must be >= 0"),
        (["model.optim.betas=[0.9,1.0]"], "model.optim.betas", "in [0, 1)"),
        (["model.optim.eps=0"], "model.optim.eps", "must be > 0"),
        (["model.optim.sched.warmup_steps=-1"], "model.optim.sched.warmup_steps", ">= 0"),
        (["model.optim.bucket_cap_mb=0"], "model.optim.bucket_cap_mb", "must be > 0"),
        (["model.hidden_size=66"], "model.hidden_size", "not divisible by num_attention_heads"),
        (["model.num_query_groups=3"], "model.num_query_groups", "do not divide the 4"),
        (["model.rotary_percent=0"], "model.rotary_percent", "(0, 1]"),
        (["model.hidden_dropout=1.0"], "model.hidden_dropout", "[0, 1)"),
        (["model.activations_checkpoint_granularity=full",
          "model.activations_checkpoint_num_layers=3"],
         "model.activations_checkpoint_num_layers", "between 1 and the 2 layers of each model chunk"),
        (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps", ">= 1"),
        (["trainer.max_time=1h"], "trainer.max_time", "1h"),
        (["trainer.kto.val_check_interval=0"], "trainer.kto.val_check_interval", "an int"),
        (["trainer.kto.val_check_interval=1.5"], "trainer.kto.val_check_interval", "a float"),
        (["trainer.kto.limit_val_batches=1.5"], "trainer.kto.limit_val_batches", "in [0, 1]"),
        (["trainer.kto.limit_train_batches=-1"], "trainer.kto.limit_train_batches", "an int"),
        (["trainer.kto.limit_val_batches=all"], "trainer.kto.limit_val_batches", "got 'all'"),
        (["model.data.max_prompt_length=64"], "model.data.max_prompt_length", "between 1 and"),
        (["model.data.max_length=200"], "model.data.max_length", "exceeds model.encoder_seq"),
        (["model.kto.preference_loss_weight=-1"], "model.kto.preference_loss_weight", ">= 0"),
    ],
)  # fmt: skip
def test_megatron_core_assertions_are_checked_first(overrides, key, fragment):
    """What megatron-core would stop on with a bare assert (or a message in its own field
    names) is reported first, naming our key."""
    with pytest.raises(ConfigError) as info:
        compose_run_config("gpt_kto", overrides)
    message = str(info.value)
    assert message.startswith(f"{key}:") and fragment in message, message


@pytest.mark.parametrize(
    "spelling,canonical",
    [("32", "32"), ("32-true", "32"), ("bf16", "bf16"), ("bf16-mixed", "bf16"),
     ("16", "16"), ("16-mixed", "16")],
)  # fmt: skip
def test_precision_spellings(spelling, canonical):
    cfg = compose_run_config("gpt_kto", [f"trainer.precision={spelling}"]).cfg
    assert cfg.trainer.precision == canonical


@pytest.mark.parametrize(
    "machine,overrides,precision,note",
    [
        (Accelerator(cuda=False), [], "32",
         "trainer.precision unset: 32 (no CUDA device; fp32 is the fast setting on a CPU)"),
        (Accelerator(cuda=True), [], "bf16", "trainer.precision unset: bf16 (a CUDA device)"),
        # An explicit value always wins, and is not announced as a default.
        (Accelerator(cuda=False), ["trainer.precision=bf16-mixed"], "bf16", None),
        (Accelerator(cuda=True), ["trainer.precision=32"], "32", None),
        (Accelerator(cuda=True), ["trainer.precision=16"], "16", None),
    ],
)  # fmt: skip
def test_unset_precision_follows_the_device(monkeypatch, machine, overrides, precision, note):
    _state(monkeypatch, machine)
    prepared = compose_run_config("gpt_kto", [*REAL, *overrides])
    assert prepared.cfg.trainer.precision == precision
    said = [n for n in prepared.notes if n.startswith("trainer.precision unset")]
    assert said == ([note] if note else [])
    # The half-precision-on-a-CPU warning only for a half precision the user chose.
    slow = [n for n in prepared.notes if "on a CPU: half-precision matmuls" in n]
    assert len(slow) == (1 if not machine.cuda and precision != "32" else 0)


def test_the_bundled_examples_state_fp32():
    """The examples keep their printed losses on every device: they set fp32 themselves."""
    for name, algorithm in (("gpt_kto", "kto"), ("gpt_dpo", "dpo")):
        prepared = compose_run_config(name, [], algorithm)
        assert prepared.cfg.trainer.precision == "32"
        assert not any(n.startswith("trainer.precision unset") for n in prepared.notes)


def test_counts_and_fractions_keep_nemo_meaning():
    """An int is a number of steps/batches, a float a fraction: 1 is one batch, 1.0 all."""
    from types import SimpleNamespace

    from megatron_kto.algorithms.dpo import resolve_loop

    def loop(**kw):
        base = dict(max_epochs=1, max_steps=-1, val_check_interval=0.25, save_interval=0,
                    limit_train_batches=1.0, limit_val_batches=1.0)  # fmt: skip
        return resolve_loop(SimpleNamespace(**{**base, **kw}), 40, 8, 16, 1, None)

    assert loop().steps_per_epoch == 40 and loop().val_check_interval == 10
    assert loop(limit_train_batches=1).steps_per_epoch == 1
    assert loop(limit_train_batches=0.5).steps_per_epoch == 20
    assert loop(limit_val_batches=1).limit_val_batches == 1
    assert loop(limit_val_batches=1.0).limit_val_batches == 8
    assert loop(val_check_interval=1).val_check_interval == 1
    assert loop(val_check_interval=1.0).val_check_interval == 40  # once per epoch
    composed = _compose("gpt_kto", ["trainer.kto.limit_val_batches=1"]).trainer.kto
    assert composed.limit_val_batches == 1 and isinstance(composed.limit_val_batches, int)


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.accelerator=gpu", "trainer.accelerator: unknown config key: a NeMo-Aligner/"
         "Lightning key with no effect here (the device is CUDA when present, else the CPU)"),
        ("+model.kto.average_log_probs=true", "model.kto.average_log_probs: unknown config key: "
         "a NeMo-Aligner key; here it is model.kto.preference_average_log_probs"),
    ],
)  # fmt: skip
def test_nemo_keys_on_our_config_say_what_they_are(override, message):
    """On our own config a NeMo-only key is still an error, but one that says what it is."""
    from megatron_kto.config.keys import check_known_keys, composition_error_line

    try:
        check_known_keys(_compose("gpt_kto", [override]))
    except ConfigError as e:
        line = str(e)
    except (ConfigCompositionException, ConfigKeyError) as e:
        line = composition_error_line(e)
    assert line.startswith(message), line


MOE_AUX = ["model.num_moe_experts=4", "model.moe_aux_loss_coeff=0.01"]


@pytest.mark.parametrize(
    "overrides,world,refused",
    [
        # Pipeline stages share the balance statistics (models.router_stats): allowed.
        (["model.pipeline_model_parallel_size=2", "model.num_layers=4"], 2, False),
        (
            [
                "model.pipeline_model_parallel_size=2",
                "model.virtual_pipeline_model_parallel_size=2",
                "model.num_layers=4",
                "model.global_batch_size=4",
                "model.micro_batch_size=1",
                "model.kto.log_prob_forward_micro_batch_size=2",
            ],
            2,
            True,
        ),
        (["model.activations_checkpoint_granularity=full"], 1, True),
        (["model.activations_checkpoint_granularity=selective"], 1, False),
        # A stage holding only dense layers has no router and shares zeros: allowed.
        (
            [
                "model.pipeline_model_parallel_size=2",
                "model.num_layers=4",
                "model.moe_layer_freq=[0,0,1,1]",
            ],
            2,
            False,
        ),
    ],
)
def test_moe_aux_loss_layouts(overrides, world, refused):
    if not refused:
        compose_run_config("gpt_kto", [*MOE_AUX, *overrides], "kto", world_size=world)
        return
    with pytest.raises(ConfigError) as info:
        compose_run_config("gpt_kto", [*MOE_AUX, *overrides], "kto", world_size=world)
    message = str(info.value)
    assert message.startswith("model.moe_aux_loss_coeff:"), message
    assert "\n" not in message


MOE = ["model.num_moe_experts=4"]
TP2 = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        # ETP x EP x expert-DP x PP tiles the world: at TP=2, ETP=1, EP=2 the two TP ranks
        # split the experts between them (DP=1); at TP=1, ETP=2, EP=2 on 4 ranks each expert
        # is split over two data-parallel ranks.
        ([*MOE, *TP2, "model.expert_tensor_parallel_size=1", "model.expert_model_parallel_size=2"], 2, None),
        ([*MOE, "model.expert_tensor_parallel_size=2", "model.expert_model_parallel_size=2"], 4, None),
        ([*MOE, "model.expert_tensor_parallel_size=1"], 1, None),  # = TP: nothing to say
        (["model.expert_tensor_parallel_size=1"], 1, None),  # a dense model at ETP = TP
        # EP = 1 too: the experts are marked expert-parallel at every EP size.
        ([*MOE, *TP2, "model.expert_tensor_parallel_size=1"], 2, None),
        (
            ["model.expert_tensor_parallel_size=2"],
            2,
            "model.expert_tensor_parallel_size: 2 (not TP=1) needs a mixture-of-experts model",
        ),
        (
            [*MOE, "model.expert_tensor_parallel_size=0"],
            1,
            "model.expert_tensor_parallel_size: must be >= 1, got 0",
        ),
        (
            [*MOE, "model.expert_tensor_parallel_size=3", "model.expert_model_parallel_size=2"],
            6,
            "model.expert_tensor_parallel_size: 3 does not divide the experts' hidden size 128",
        ),
        (
            [*MOE, *TP2, "model.expert_tensor_parallel_size=1", "model.expert_model_parallel_size=4"],
            2,
            "model.expert_tensor_parallel_size: ETP x EP = 1 x 4 does not divide the 2 ranks",
        ),
        (
            [*MOE, "model.expert_tensor_parallel_size=2", "model.expert_model_parallel_size=2"],
            2,
            "model.expert_tensor_parallel_size: ETP x EP = 2 x 2 does not divide the 2 ranks",
        ),
    ],
)  # fmt: skip
def test_expert_tensor_parallel_layouts(overrides, world, message):
    """ETP is checked on the experts' own grid (ETP x EP x expert-DP x PP = world), one line
    naming the key; the EP checks keep their meaning at ETP = TP."""
    if message is None:
        compose_run_config("gpt_kto", overrides, "kto", world_size=world)
        return
    with pytest.raises(ConfigError) as info:
        compose_run_config("gpt_kto", overrides, "kto", world_size=world)
    line = str(info.value)
    assert line.startswith(message), line
    assert "\n" not in line
