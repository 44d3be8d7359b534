"""A NeMo-Aligner gpt_kto.yaml, brought as it is (`--config-path/--config-name`), trains.

`tests/data/nemo_aligner/gpt_kto.yaml` holds every key of NeMo-Aligner's gpt_kto.yaml with its
default value. Composed the way the entry script composes a user's file, each key is either
honoured (same meaning here), renamed, listed once as having no effect, or refused in one line;
an unknown key is an error. The end-to-end test trains 2 steps from it with the overrides a user
would give (sizes, paths), and checks that the keys it honours show in what the run did.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_cli import KTO_SCRIPT, REPO, TOKENIZER, TRAIN_DATA, VALIDATION_DATA, cli_env, read_metrics
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from megatron_kto.config.nemo_aligner import adapt_nemo_aligner_config
from megatron_kto.config.validate import ConfigError

NEMO_DIR = Path(__file__).resolve().parent / "data" / "nemo_aligner"
USER = ["trainer.devices=1", "trainer.num_nodes=1"]

#: What the fixture's keys become here, sorted by hand from NeMo-Aligner's key list.
NO_EFFECT = [
    "trainer.accelerator",
    "trainer.gradient_clip_val",
    "trainer.logger",
    "trainer.enable_checkpointing",
    "trainer.use_distributed_sampler",
    "trainer.max_epochs",
    "trainer.max_steps",
    "exp_manager.exp_dir",
    "exp_manager.name",
    "exp_manager.max_time_per_run",
    "exp_manager.resume_from_checkpoint",
    "exp_manager.resume_ignore_no_checkpoint",
    "exp_manager.checkpoint_callback_params.monitor",
    "exp_manager.checkpoint_callback_params.mode",
    "exp_manager.checkpoint_callback_params.always_save_nemo",
    "exp_manager.checkpoint_callback_params.save_nemo_on_train_end",
    "exp_manager.checkpoint_callback_params.filename",
    "exp_manager.checkpoint_callback_params.model_parallel_size",
    "model.mcore_gpt",
    "model.megatron_amp_O2",
    "model.peft.restore_from_ckpt",
    "model.optim.contiguous_grad_buffer",
    "model.data.data_impl",
    "model.data.splits_string",
    "model.data.seq_length",
    "model.data.skip_warmup",
    "model.data.dataloader_type",
    "model.data.reset_position_ids",
    "model.data.reset_attention_mask",
    "model.data.eod_mask_loss",
    "model.data.index_mapping_dir",
    "model.overwrite_base_config",
    "precision",
]


def _adapt(overrides: list[str], algorithm: str = "kto"):
    with initialize_config_dir(config_dir=str(NEMO_DIR), version_base="1.3"):
        cfg = compose(config_name="gpt_kto", overrides=[*USER, *overrides])
    return adapt_nemo_aligner_config(cfg, algorithm)


def test_every_key_is_honoured_or_listed():
    cfg, ignored = _adapt([])
    assert ignored == NO_EFFECT
    m, t = cfg.model, cfg.trainer
    # Honoured with NeMo's meaning (and NeMo's interpolations resolved).
    assert (t.num_nodes, t.devices, t.precision, t.max_time) == (1, 1, "bf16", None)
    assert t.kto.val_check_interval == 0.1 and isinstance(t.kto.val_check_interval, float)
    assert (t.kto.max_epochs, t.kto.max_steps, t.kto.save_interval) == (1, -1, 100)
    assert (t.kto.limit_train_batches, t.kto.limit_val_batches) == (1.0, 1.0)
    assert t.kto.gradient_clip_val == 1.0
    assert (m.micro_batch_size, m.global_batch_size, m.seed) == (1, 64, 1234)
    assert m.kto.log_prob_forward_micro_batch_size == 2  # ${multiply:micro_batch_size, 2}
    assert (m.kto.ref_policy_kl_penalty, m.kto.preference_loss_weight) == (0.2, 1.0)
    assert m.kto.sft_average_log_probs is False  # ${.preference_average_log_probs}
    assert (m.kto.desirable_loss_weight, m.kto.undesirable_loss_weight) == (1.0, 1.0)
    o = m.optim
    assert (o.name, o.lr, o.weight_decay, list(o.betas)) == (
        "distributed_fused_adam", 9e-6, 0.1, [0.9, 0.98],
    )  # fmt: skip
    assert (o.overlap_grad_sync, o.bucket_cap_mb) == (False, 200.0)
    assert (o.sched.name, o.sched.warmup_steps, o.sched.constant_steps, o.sched.min_lr) == (
        "CosineAnnealing", 10, 1000, 9e-7,
    )  # fmt: skip
    e = cfg.exp_manager
    assert (e.explicit_log_dir, e.resume_if_exists, e.create_checkpoint_callback) == (
        "/results", True, True,
    )  # fmt: skip
    assert e.checkpoint_callback_params.save_top_k == 3
    assert e.wandb_logger_kwargs.project == "nemo_aligner_kto"
    assert m.data.num_workers == 0 and list(m.data.data_prefix.train) == []  # data_prefix: null


def test_data_prefix_test_split_has_no_effect():
    cfg, ignored = _adapt(["model.data.data_prefix={train:[a.jsonl],validation:b.jsonl,test:[c]}"])
    assert list(cfg.model.data.data_prefix.train) == ["a.jsonl"]
    assert list(cfg.model.data.data_prefix.validation) == ["b.jsonl"]
    assert "model.data.data_prefix.test" in ignored


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "model.peft.restore_from_ckpt.checkpoint_dir=/nemo/lora",
            "model.peft.restore_from_ckpt.checkpoint_dir: '/nemo/lora' is not supported: a "
            "starting adapter is model.peft.restore_from_path",
        ),
        ("model.mcore_gpt=false", "model.mcore_gpt: False is not supported"),
        (
            "exp_manager.resume_from_checkpoint=/ckpt/x.ckpt",
            "exp_manager.resume_from_checkpoint: '/ckpt/x.ckpt' is not supported: resuming",
        ),
        (
            "exp_manager.resume_ignore_no_checkpoint=false",
            "exp_manager.resume_ignore_no_checkpoint: False is not supported",
        ),
        (
            "trainer.gradient_clip_val=0.5",
            "trainer.gradient_clip_val: 0.5 is not supported: the clip is "
            "trainer.kto.gradient_clip_val; set that one",
        ),
        (
            "exp_manager.max_time_per_run=00:01:00:00",
            "exp_manager.max_time_per_run: '00:01:00:00' is not supported: the run-time limit "
            "is trainer.max_time",
        ),
        ("+trainer.accumulate_grad_batches=4", "trainer.accumulate_grad_batches: 4 is not"),
        (
            "+model.kto.ref_policy_kl_penatly=0.1",
            "model.kto.ref_policy_kl_penatly: unknown config key (did you mean "
            "'ref_policy_kl_penalty'?)",
        ),
        ("model.kto.ref_policy_kl_penalty=high", "model.kto.ref_policy_kl_penalty: Value 'high'"),
    ],
)
def test_values_that_would_change_results_are_refused(override, message):
    with pytest.raises(ConfigError) as info:
        _adapt([override])
    assert str(info.value).startswith(message), str(info.value)


def test_peft_block_is_honoured():
    """NeMo-Aligner's stock model.peft block, switched to LoRA, keeps its meaning here."""
    cfg, ignored = _adapt(["model.peft.peft_scheme=lora"])
    p = cfg.model.peft
    assert p.peft_scheme == "lora" and p.restore_from_path is None
    lt = p.lora_tuning
    assert (list(lt.target_modules), lt.adapter_dim, lt.adapter_dropout) == (
        ["attention_qkv"], 32, 0.0,
    )  # fmt: skip
    assert (lt.column_init_method, lt.row_init_method, lt.layer_selection) == (
        "xavier", "zero", None,
    )  # fmt: skip
    assert "model.peft.restore_from_ckpt" in ignored
    from megatron_kto.peft.settings import check_peft

    tied, _ = _adapt(["model.peft.peft_scheme=lora", "model.peft.lora_tuning.weight_tying=true"])
    with pytest.raises(ConfigError, match=r"^model.peft.lora_tuning.weight_tying: not implemented"):
        check_peft(tied.model, "kto", tied.model)


def test_fault_keys_pass_through():
    """NeMo-Aligner's configs have no collective timeout or non-finite policy; ours, added to
    one (Megatron-LM's `distributed_timeout_minutes` name), keep their meaning."""
    cfg, ignored = _adapt(["+trainer.distributed_timeout_minutes=5", "+trainer.non_finite=skip"])
    assert cfg.trainer.distributed_timeout_minutes == 5 and cfg.trainer.non_finite == "skip"
    assert not [k for k in ignored if "timeout" in k or "non_finite" in k]


def test_renamed_keys():
    """Older NeMo-Aligner KTO configs spell preference_average_log_probs `average_log_probs`;
    the `sft_average_log_probs: ${.preference_average_log_probs}` default follows it."""
    cfg, _ = _adapt(
        ["~model.kto.preference_average_log_probs", "+model.kto.average_log_probs=true"]
    )
    assert cfg.model.kto.preference_average_log_probs is True
    assert cfg.model.kto.sft_average_log_probs is True


def _dpo(values: dict):
    base = {"trainer": {"dpo": {"max_steps": 3}}, "model": {"dpo": values}}
    return adapt_nemo_aligner_config(OmegaConf.create(base), "dpo")


def test_dpo_keys():
    cfg, ignored = _dpo(
        {
            "preference_loss": "ipo",
            "gt_reward_scale": 2.0,
            "preference_loss_weight": 0.5,
            "sft_average_log_probs": False,
        }  # fmt: skip
    )
    d = cfg.model.dpo
    assert (d.loss_type, d.preference_loss_weight, d.sft_average_log_probs) == ("ipo", 0.5, False)
    assert d.gt_reward_scale == 2.0 and ignored == []
    assert _dpo({"preference_loss": "dpo"})[0].model.dpo.loss_type == "sigmoid"
    with pytest.raises(ConfigError, match=r"^model.dpo.preference_loss: 'rpo_xx' is not supported"):
        _dpo({"preference_loss": "rpo_xx"})


@pytest.mark.parametrize("name", ["rpo_sq", "rpo_fwd_kl", "rpo_bwd_kl"])
def test_rpo_losses_keep_their_names_and_keys(name):
    """NeMo-Aligner's RPO losses are ours by the same name (`losses.dpo_types`), with its
    `gt_reward_scale` and `model.data.default_*_reward`."""
    base = {
        "trainer": {"dpo": {"max_steps": 3}},
        "model": {
            "dpo": {"preference_loss": name, "gt_reward_scale": 0.5},
            "data": {"default_chosen_reward": 1.0, "default_rejected_reward": 0.0},
        },
    }
    cfg, ignored = adapt_nemo_aligner_config(OmegaConf.create(base), "dpo")
    assert (cfg.model.dpo.loss_type, cfg.model.dpo.gt_reward_scale) == (name, 0.5)
    assert (cfg.model.data.default_chosen_reward, cfg.model.data.default_rejected_reward) == (
        1.0, 0.0,
    )  # fmt: skip
    assert ignored == []


#: NeMo's MoE model keys with the values of a Mixtral / Qwen3-MoE recipe (megatron-core names).
MOE_KEYS = {
    "moe_router_load_balancing_type": "aux_loss",
    "moe_token_dispatcher_type": "alltoall",
    "moe_grouped_gemm": True,
    "moe_permute_fusion": True,
    "moe_shared_expert_overlap": False,
    "moe_per_layer_logging": True,
    "moe_layer_recompute": False,
    "moe_z_loss_coeff": None,
    "moe_input_jitter_eps": None,
    "moe_expert_capacity_factor": None,
    "moe_pad_expert_input_to_capacity": False,
    "moe_token_drop_policy": "probs",
    "moe_router_dtype": None,
    "moe_extended_tp": False,
}
#: NeMo's MoE keys that are ours (same name, same meaning), with typical values.
MOE_SHARED = {
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_aux_loss_coeff": 0.01,
    "moe_router_score_function": "softmax",
    "moe_router_topk_scaling_factor": None,
    "moe_router_enable_expert_bias": False,
    "moe_router_bias_update_rate": 0.0,
}


def _moe_overrides(keys: dict) -> list[str]:
    return [f"+model.{k}={'null' if v is None else v}" for k, v in keys.items()]


def test_moe_keys_are_honoured_or_listed():
    cfg, ignored = _adapt(_moe_overrides({**MOE_SHARED, **MOE_KEYS, "moe_layer_freq": 1}))
    assert ignored == NO_EFFECT[:-1] + [f"model.{k}" for k in MOE_KEYS] + ["precision"]
    m = cfg.model
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_aux_loss_coeff) == (4, 2, 0.01)
    # moe_layer_freq is ours: NeMo's integer 1 (every layer MoE) is our default, a list is kept.
    assert m.moe_layer_freq is None
    assert _adapt(["+model.moe_layer_freq=1"])[0].model.moe_layer_freq is None
    assert list(_adapt(["+model.moe_layer_freq=[1,0,1,0]"])[0].model.moe_layer_freq) == [1, 0, 1, 0]
    # 'none' balancing is what a zero coefficient does; an fp32 router is an fp32 run's.
    none, _ = _adapt(
        _moe_overrides({"moe_aux_loss_coeff": 0.0, "moe_router_load_balancing_type": "none"})
    )
    assert none.model.moe_aux_loss_coeff == 0.0
    _adapt(["trainer.precision=32", "+model.moe_router_dtype=fp32"])


@pytest.mark.parametrize(
    "override,message",
    [
        ("moe_router_load_balancing_type=sinkhorn", "'sinkhorn' is not supported: the load-bal"),
        ("moe_router_load_balancing_type=none", "'none' is not supported: the load-balancing"),
        ("moe_z_loss_coeff=0.001", "0.001 is not supported: the router z-loss is not impl"),
        ("moe_input_jitter_eps=0.01", "0.01 is not supported: router input jitter"),
        ("moe_expert_capacity_factor=1.0", "1.0 is not supported: routing is dropless here"),
        ("moe_pad_expert_input_to_capacity=true", "True is not supported: routing is dropless"),
        ("moe_router_dtype=fp32", "'fp32' is not supported: the router computes in the run's"),
        ("moe_extended_tp=true", "True is not supported: extended tensor parallelism"),
        ("moe_layer_freq=2", "2: give one 1 (MoE) or 0 (dense) per layer, e.g. [1,0,1,0]"),
    ],
)
def test_moe_values_that_would_change_results_are_refused(override, message):
    """Each is one line naming the key (the caller prints it as `error: ...`, exit code 2)."""
    with pytest.raises(ConfigError) as info:
        _adapt([f"+model.{override}"])
    text = str(info.value)
    assert text.startswith(f"model.{override.split('=')[0]}: {message}"), text
    assert "\n" not in text


def _tiny_qwen3_moe_dir(directory: Path) -> Path:
    """A random tiny Qwen3-MoE Hugging Face directory with the bundled tokenizer's vocabulary."""
    import torch
    from hf_tiny import tiny_qwen3_moe_config
    from transformers import AutoModelForCausalLM

    from megatron_kto.data.tokenizers import load_tokenizer

    torch.manual_seed(0)
    vocab = load_tokenizer("sentencepiece", str(TOKENIZER)).vocab_size
    config = tiny_qwen3_moe_config(vocab, router_aux_loss_coef=0.01)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.mark.e2e
@pytest.mark.parametrize("peft", ["none", "lora", "moe"])
def test_trains_two_steps_from_the_nemo_aligner_config(tmp_path, peft):
    """The user's command: their config file, their overrides for this machine and data; with
    `model.peft.peft_scheme=lora` the stock LoRA block (attention_qkv, rank 32) trains; `moe`
    trains a Hugging Face Qwen3-MoE directory with NeMo's MoE keys in the model section."""
    from e2e_cli import save_initial_checkpoint

    moe = peft == "moe"
    if moe:
        init = _tiny_qwen3_moe_dir(tmp_path / "init")
        peft = "none"
    else:
        init = save_initial_checkpoint(tmp_path / "init", seed=11)
    log_dir = tmp_path / "run"
    data = f"{{train:[{TRAIN_DATA}],validation:[{VALIDATION_DATA}],test:[{VALIDATION_DATA}]}}"
    outputs_before = (REPO / "outputs").exists()
    args = [
        "--config-path", str(NEMO_DIR), "--config-name", "gpt_kto",
        *USER,
        "trainer.kto.max_steps=2",
        "trainer.kto.limit_val_batches=2",
        "model.global_batch_size=8",
        f"pretrained_checkpoint.restore_from_path={init}",
        f"model.data.data_prefix={data}",
        "+model.tokenizer.library=sentencepiece",
        f"+model.tokenizer.model={TOKENIZER}",
        f"exp_manager.explicit_log_dir={log_dir}",
        f"model.peft.peft_scheme={peft}",
        *(_moe_overrides({"moe_aux_loss_coeff": 0.01, **MOE_KEYS}) if moe else []),
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(KTO_SCRIPT), *args],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    warning, *rest = proc.stderr.strip().splitlines()
    assert rest == [], proc.stderr  # nothing else on stderr: no third-party noise either
    assert warning.startswith("warning: these NeMo-Aligner/Lightning keys have no effect")
    assert warning.count("trainer.accelerator") == 1 and "model.data.data_prefix.test" in warning
    assert all((f"model.{k}" in warning) == moe for k in MOE_KEYS), warning
    assert "Traceback" not in proc.stdout
    # Hydra's default outputs/<date>/ directory is not created for a config that leaves it on.
    assert (REPO / "outputs").exists() == outputs_before
    train = read_metrics(log_dir)
    assert [r["step"] for r in train] == [1, 2]
    # model.optim: lr 9e-6 with 10 warm-up steps (step k uses lr·k/11).
    assert train[0]["lr"] == pytest.approx(9e-6 / 11) and train[1]["lr"] == pytest.approx(
        2 * 9e-6 / 11
    )
    assert len(read_metrics(log_dir, "val")) == 1  # val_check_interval 0.1 of 128 steps: at the end
    saved = OmegaConf.load(log_dir / "checkpoints" / "step_2" / "config.yaml")
    assert saved.model.kto.ref_policy_kl_penalty == 0.2
    assert saved.model.optim.name == "distributed_fused_adam" and saved.trainer.precision == "bf16"
    meta = json.loads((log_dir / "checkpoints" / "step_2" / "checkpoint.json").read_text())
    assert meta["step"] == 2
    assert saved.model.peft.peft_scheme == peft
    if moe:  # the model trained is the directory's MoE, with its load-balancing loss
        assert saved.model.num_moe_experts == 4 and saved.model.moe_aux_loss_coeff == 0.01
        assert all(r["aux_loss"] > 0 for r in train)
    if peft == "lora":
        (line,) = [x for x in proc.stdout.splitlines() if x.startswith("LoRA:")]
        assert "reference = the base model (adapters off)" in line
        assert saved.model.kto.reference_policy == "adapters_off"
        assert train[0]["loss"] == pytest.approx(0.5, abs=1e-6)  # B = 0: policy = reference


def test_migration_guide_covers_every_rule():
    """docs/migrating_from_nemo_aligner.md names every key the adapter treats specially."""
    from megatron_kto.config.nemo_aligner import RULES

    guide = (REPO / "docs" / "migrating_from_nemo_aligner.md").read_text()
    missing = [key for key in RULES if f"`{key}" not in guide]
    assert not missing, missing
