"""Bring a NeMo-Aligner `gpt_kto.yaml` / `gpt_dpo.yaml` as it is.

A NeMo-Aligner config given with `--config-path/--config-name` composes without our schema.
`adapt_nemo_aligner_config` sorts its keys against the table below and returns a config in our
schema plus the keys that have no effect here (the caller lists them in one warning):

- keys we share (most of them: trainer.kto.*, model.kto.*, model.optim.*, ...) pass through
  with NeMo's meaning;
- renamed keys are moved (`model.dpo.preference_loss: dpo` -> `model.dpo.loss_type: sigmoid`);
- Lightning/NeMo plumbing (`trainer.accelerator`, `exp_manager.exp_dir`, `model.mcore_gpt`, ...)
  is accepted and reported as having no effect;
- a value that would change results and that we do not implement (resuming from an explicit
  file, ...) is refused in one line naming the key;
- anything else is an unknown key, as in our own configs.

docs/migrating_from_nemo_aligner.md is the table in prose.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_kto.config.errors import ConfigError, suggestion

#: Our own algorithm configs, whose values (not their defaults lists) a foreign config is laid
#: over, as Hydra lays command-line overrides over them.
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def register_resolvers() -> None:
    """NeMo's `${multiply:a,b}` (NeMo-Aligner configs use it; NeMo registers it on import)."""
    if not OmegaConf.has_resolver("multiply"):
        OmegaConf.register_new_resolver("multiply", lambda a, b: a * b)


@dataclass(frozen=True)
class Rule:
    """How one NeMo-Aligner key that is not in our schema is handled.

    Attributes:
        kind: "no_effect" (accepted, listed in the warning), "renamed" (moved to `target`),
            or "refused" (an error).
        note: why, for the warning, the error and the migration guide.
        target: the key it becomes (renamed).
        accept: for no_effect keys, the values that need no error, given (value, the whole
            config, the algorithm); any other value is refused with `note`. None accepts all.
        convert: for renamed keys, maps the value (raising ConfigError for unsupported ones).
    """

    kind: str
    note: str
    target: str | None = None
    accept: Callable[[Any, DictConfig, str], bool] | None = None
    convert: Callable[[Any], Any] | None = None


def _is(*values: Any) -> Callable[[Any, DictConfig, str], bool]:
    return lambda value, cfg, algorithm: value in values


def _unset_or_equal_to(path: str) -> Callable[[Any, DictConfig, str], bool]:
    """For a NeMo copy of one of our keys: fine while unset, 0 or equal to `path`'s value
    (`{algo}` in `path` is the run's kto/dpo section)."""

    def accept(value: Any, cfg: DictConfig, algorithm: str) -> bool:
        ours = OmegaConf.select(cfg, path.format(algo=algorithm), default=None)
        return value in (None, 0) or value == ours

    return accept


def _dpo_preference_loss(value: Any) -> str:
    """NeMo-Aligner's `preference_loss` as our `loss_type`: dpo is sigmoid; ipo and the RPO
    losses (rewards from the data, `gt_reward_scale`) keep their names and meaning."""
    known = {
        "dpo": "sigmoid",
        "ipo": "ipo",
        **{k: k for k in ("rpo_sq", "rpo_fwd_kl", "rpo_bwd_kl")},
    }
    if value not in known:
        raise ConfigError(
            f"model.dpo.preference_loss: {value!r} is not supported; use dpo, ipo, rpo_sq, "
            "rpo_fwd_kl or rpo_bwd_kl (our model.dpo.loss_type also offers hinge, robust, "
            "apo_zero and the rest of losses.DPO_LOSS_TYPES)"
        )
    return known[value]


_LIGHTNING = "a PyTorch Lightning setting; this trainer is megatron-core's own loop"
_NEMO_CKPT = "NeMo checkpoint-callback setting; checkpoints here are the last save_top_k saves"

_DROPLESS = (
    "routing is dropless here (every routed token is computed, as Hugging Face's MoE blocks)"
)
_MOE_SPEED = "a megatron-core MoE speed setting; the results are the same without it"


def _no_balancing_without_coefficient(value: Any, cfg: DictConfig, algorithm: str) -> bool:
    """'aux_loss' is ours; 'none' only when the stated coefficient is 0 (else we would add one)."""
    coeff = OmegaConf.select(cfg, "model.moe_aux_loss_coeff", default=None)
    return value in ("aux_loss", None) or (value == "none" and coeff == 0)


def _fp32_router_in_fp32(value: Any, cfg: DictConfig, algorithm: str) -> bool:
    """The router computes in the run's precision: an fp32 router is what an fp32 run does."""
    precision = str(OmegaConf.select(cfg, "trainer.precision", default=None))
    return value is None or (value == "fp32" and precision in ("32", "32-true"))


#: NeMo's MoE model keys (megatron-core TransformerConfig names) our schema does not have. Our MoE
#: layers are megatron-core's MoELayer with top-k routing (softmax, or sigmoid with the router
#: keys of the schema: score function, expert bias and its update rate, groups, scaling),
#: dropless, no z-loss or jitter, and Hugging Face's load-balancing loss (`model.moe_aux_loss_coeff`).
MOE_RULES: dict[str, Rule] = {
    "model.moe_router_load_balancing_type": Rule(
        "no_effect",
        "the load-balancing loss is Hugging Face's load_balancing_loss_func weighted by "
        "model.moe_aux_loss_coeff ('aux_loss'; 'none' needs model.moe_aux_loss_coeff: 0)",
        accept=_no_balancing_without_coefficient,
    ),
    "model.moe_token_dispatcher_type": Rule(
        "no_effect", "tokens always go through megatron-core's all-to-all dispatcher"
    ),
    "model.moe_grouped_gemm": Rule(
        "no_effect", "grouped experts with Transformer Engine, one MLP per expert without"
    ),
    "model.moe_permute_fusion": Rule("no_effect", _MOE_SPEED),
    "model.moe_shared_expert_overlap": Rule("no_effect", _MOE_SPEED),
    "model.moe_per_layer_logging": Rule(
        "no_effect", "the log has the whole model's aux_loss (train.jsonl)"
    ),
    "model.moe_layer_recompute": Rule(
        "no_effect",
        "a memory setting; layers are recomputed under model.activations_checkpoint_granularity",
    ),
    "model.moe_z_loss_coeff": Rule(
        "no_effect", "the router z-loss is not implemented", accept=_is(None, 0, 0.0)
    ),
    "model.moe_input_jitter_eps": Rule(
        "no_effect", "router input jitter is not implemented", accept=_is(None, 0, 0.0)
    ),
    "model.moe_expert_capacity_factor": Rule("no_effect", _DROPLESS, accept=_is(None)),
    "model.moe_pad_expert_input_to_capacity": Rule("no_effect", _DROPLESS, accept=_is(False, None)),
    "model.moe_token_drop_policy": Rule("no_effect", _DROPLESS),
    "model.moe_router_dtype": Rule(
        "no_effect",
        "the router computes in the run's precision (fp32 only in an fp32 run)",
        accept=_fp32_router_in_fp32,
    ),
    "model.moe_extended_tp": Rule(
        "no_effect",
        "extended tensor parallelism is not in megatron-core 0.16.1 (experts split over "
        "model.expert_model_parallel_size)",
        accept=_is(False, None),
    ),
}


#: Keys of NeMo-Aligner's gpt_kto.yaml / gpt_dpo.yaml (and common Lightning trainer keys) that
#: our schema does not have. A pattern ending in ".*" covers every key below that prefix.
RULES: dict[str, Rule] = {
    "trainer.accelerator": Rule("no_effect", "the device is CUDA when present, else the CPU"),
    "trainer.logger": Rule("no_effect", _LIGHTNING),
    "trainer.enable_checkpointing": Rule("no_effect", _LIGHTNING),
    "trainer.use_distributed_sampler": Rule("no_effect", _LIGHTNING),
    "trainer.enable_progress_bar": Rule("no_effect", _LIGHTNING),
    "trainer.enable_model_summary": Rule("no_effect", _LIGHTNING),
    "trainer.num_sanity_val_steps": Rule("no_effect", _LIGHTNING),
    "trainer.benchmark": Rule("no_effect", _LIGHTNING),
    "trainer.strategy": Rule("no_effect", _LIGHTNING),
    "trainer.accumulate_grad_batches": Rule(
        "no_effect",
        "gradient accumulation is global_batch_size / (micro_batch_size x data-parallel size)",
        accept=_is(1, None),
    ),
    # NeMo-Aligner's own loop ignores these two as well (its limits are trainer.kto.*).
    "trainer.max_epochs": Rule("no_effect", "the limit is trainer.{algo}.max_epochs"),
    "trainer.max_steps": Rule("no_effect", "the limit is trainer.{algo}.max_steps"),
    "trainer.gradient_clip_val": Rule(
        "no_effect",
        "the clip is trainer.{algo}.gradient_clip_val; set that one",
        accept=_unset_or_equal_to("trainer.{algo}.gradient_clip_val"),
    ),
    "precision": Rule("no_effect", "NeMo's copy of trainer.precision"),
    "exp_manager.exp_dir": Rule("no_effect", "the run directory is exp_manager.explicit_log_dir"),
    "exp_manager.name": Rule("no_effect", "the run directory is exp_manager.explicit_log_dir"),
    "exp_manager.max_time_per_run": Rule(
        "no_effect",
        "the run-time limit is trainer.max_time; set that one",
        accept=_unset_or_equal_to("trainer.max_time"),
    ),
    "exp_manager.resume_ignore_no_checkpoint": Rule(
        "no_effect",
        "a run directory without a checkpoint starts from pretrained_checkpoint.restore_from_path",
        accept=_is(True, None),
    ),
    "exp_manager.resume_from_checkpoint": Rule(
        "no_effect",
        "resuming from an explicit file is not supported: a run resumes from "
        "<explicit_log_dir>/checkpoints/latest (use pretrained_checkpoint.restore_from_path to "
        "start from a checkpoint's weights)",
        accept=_is(None),
    ),
    "exp_manager.checkpoint_callback_params.*": Rule("no_effect", _NEMO_CKPT),
    "model.mcore_gpt": Rule(
        "no_effect", "the model is always megatron-core's GPTModel", accept=_is(True)
    ),
    "model.megatron_amp_O2": Rule(
        "no_effect",
        "half-precision runs always keep half-precision weights with an fp32 master copy "
        "in the optimizer (O2)",
    ),
    "model.peft.restore_from_ckpt.*": Rule(
        "no_effect",
        "a starting adapter is model.peft.restore_from_path (a Hugging Face PEFT directory); a "
        "run resumes its own adapters from <explicit_log_dir>/checkpoints/latest",
        accept=_is(None),
    ),
    "model.optim.contiguous_grad_buffer": Rule(
        "no_effect", "megatron-core DDP always reduces from one contiguous buffer"
    ),
    "model.kto.average_log_probs": Rule(
        "renamed", "older NeMo-Aligner name", target="model.kto.preference_average_log_probs"
    ),
    "model.dpo.preference_loss": Rule(
        "renamed",
        "dpo -> sigmoid; ipo, rpo_sq, rpo_fwd_kl, rpo_bwd_kl keep their names",
        target="model.dpo.loss_type",
        convert=_dpo_preference_loss,
    ),
    "model.data.pad_length_to_multiple_of": Rule(
        "renamed", "same meaning", target="model.data.pad_to_multiple_of"
    ),
    "model.data.data_prefix.test": Rule(
        "no_effect", "there is no test pass; validation is data_prefix.validation"
    ),
    "model.data.data_impl": Rule(
        "no_effect", "the format is read from each file (JSONL, JSON, Parquet, datasets)"
    ),
    "model.data.splits_string": Rule("no_effect", "splits are data_prefix.train / validation"),
    "model.data.seq_length": Rule("no_effect", "the length limit is model.data.max_length"),
    "model.data.skip_warmup": Rule("no_effect", "NeMo pretraining-dataset setting"),
    "model.data.dataloader_type": Rule(
        "no_effect", "batches come from megatron-style global-batch samplers"
    ),
    "model.data.reset_position_ids": Rule("no_effect", "NeMo pretraining-dataset setting"),
    "model.data.reset_attention_mask": Rule("no_effect", "NeMo pretraining-dataset setting"),
    "model.data.eod_mask_loss": Rule("no_effect", "NeMo pretraining-dataset setting"),
    "model.data.index_mapping_dir": Rule(
        "no_effect", "tokenised data is cached beside the data files"
    ),
    "model.overwrite_base_config.*": Rule("no_effect", "there is no .nemo base config to merge"),
    "model.ub_tp_comm_overlap_cfg.*": Rule(
        "no_effect", "Transformer Engine userbuffer settings are not used"
    ),
    "model.max_position_embeddings": Rule(
        "no_effect", "the position limit is model.encoder_seq_length (from the checkpoint)"
    ),
    **MOE_RULES,
}


def _rule_for(path: str) -> tuple[str, Rule] | None:
    if path in RULES:
        return path, RULES[path]
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        pattern = ".".join(parts[:i]) + ".*"
        if pattern in RULES:
            return pattern, RULES[pattern]
    return None


def _shown_key(path: str, schema: DictConfig) -> str:
    """How a key is listed: a whole subtree we do not have (model.peft.*) is one entry; keys
    under one of ours (exp_manager.checkpoint_callback_params.monitor) are listed one by one."""
    parts = path.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if f"{prefix}.*" in RULES and OmegaConf.select(schema, prefix, default=None) is None:
            return prefix
    return path


def is_no_effect_key(path: str) -> bool:
    """True when `path` is a NeMo/Lightning key this package accepts with no effect."""
    found = _rule_for(path)
    return found is not None and found[1].kind == "no_effect"


def describe_key(path: str) -> str | None:
    """One line about a NeMo-Aligner key we do not share (for messages), or None."""
    found = _rule_for(path)
    if found is None:
        return None
    rule = found[1]
    if rule.kind == "renamed":
        return f"a NeMo-Aligner key; here it is {rule.target}"
    return (
        f"a NeMo-Aligner/Lightning key with no effect here ({rule.note}); drop it, or bring "
        "your NeMo-Aligner config file as it is (--config-path/--config-name)"
    )


def _set(container: dict, path: str, value: Any) -> None:
    node = container
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value


def _base_config(algorithm: str) -> DictConfig:
    """Our schema with conf/gpt_<algorithm>.yaml's own values (not its defaults list)."""
    from megatron_kto.config.schema import AlignmentConfig

    base = OmegaConf.structured(AlignmentConfig)
    path = CONF_DIR / f"gpt_{algorithm}.yaml"
    if path.is_file():
        values = OmegaConf.load(path)
        for key in ("defaults", "hydra"):
            values.pop(key, None)
        base = OmegaConf.merge(base, values)
    return base


def adapt_nemo_aligner_config(cfg: DictConfig, algorithm: str) -> tuple[DictConfig, list[str]]:
    """Turn a composed NeMo-Aligner config into one of our schema.

    Args:
        cfg: a config composed without our schema (its own interpolations unresolved).
        algorithm: 'kto' or 'dpo' (whose section `{algo}` notes refer to).

    Returns:
        (the config in our schema, the keys given that have no effect here, in order).

    Raises:
        ConfigError: a refused value, an unknown key, or a value of the wrong type, naming it.
    """
    from megatron_kto.config.schema import AlignmentConfig

    register_resolvers()
    schema = OmegaConf.structured(AlignmentConfig)
    raw = OmegaConf.to_container(cfg, resolve=False)
    kept: dict[str, Any] = {}
    no_effect: list[str] = []

    def handle(path: str, value: Any) -> bool:
        """Apply a rule to `path`; True when handled."""
        found = _rule_for(path)
        if found is None:
            return False
        pattern, rule = found
        note = rule.note.format(algo=algorithm)
        if rule.kind == "renamed":
            if value is not None:
                _set(kept, rule.target, rule.convert(value) if rule.convert else value)
            return True
        if rule.accept is not None:
            resolved = OmegaConf.select(cfg, path, default=None, throw_on_resolution_failure=False)
            if not rule.accept(resolved, cfg, algorithm):
                raise ConfigError(f"{path}: {resolved!r} is not supported: {note}")
        shown = _shown_key(path, schema)
        if shown not in no_effect:
            no_effect.append(shown)
        return True

    def walk(node: dict, schema_node: Any, prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            known = isinstance(schema_node, DictConfig) and key in schema_node
            if not known:
                if isinstance(value, dict) and _rule_for(path) is None:
                    # A container we do not have whose leaves may still be rules (peft, ...).
                    if any(r.startswith(f"{path}.") for r in RULES):
                        walk(value, None, f"{path}.")
                        continue
                if handle(path, value):
                    continue
                options = schema_node.keys() if isinstance(schema_node, DictConfig) else []
                raise ConfigError(f"{path}: unknown config key{suggestion(str(key), options)}")
            child = schema_node._get_node(key)
            if path == "model.data.data_prefix":
                value = _data_prefix(value)
                if value is None:
                    continue
            if path == "model.moe_layer_freq" and not isinstance(value, list):
                value = _moe_layer_freq(value)
                if value is None:
                    continue
            if isinstance(value, dict) and isinstance(child, DictConfig):
                walk(value, child, f"{path}.")
            else:
                _set(kept, path, value)

    walk(raw, schema, "")
    try:
        merged = OmegaConf.merge(_base_config(algorithm), kept)
        OmegaConf.resolve(merged)  # NeMo's interpolations (`${multiply:...}`, `${.x}`) now
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        message = str(getattr(e, "msg", None) or e).strip().splitlines()[0]
        raise ConfigError(f"{key}: {message}") from e
    return merged, no_effect


def _data_prefix(value: Any) -> dict | None:
    """NeMo-Aligner's `data_prefix: null` is "not given"; single paths become one-item lists."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(
            "model.data.data_prefix: expected {train: [files], validation: [files]}, got "
            f"{type(value).__name__}"
        )
    return {k: [v] if isinstance(v, str) else v for k, v in value.items()}


def _moe_layer_freq(value: Any) -> list | None:
    """NeMo's integer form: 1 (every layer MoE) is our default (None); a frequency N > 1 needs the
    layer count, which the checkpoint has, so the list form is asked for."""
    if value in (1, None):
        return None
    raise ConfigError(
        f"model.moe_layer_freq: {value!r}: give one 1 (MoE) or 0 (dense) per layer, e.g. "
        "[1,0,1,0] (the integer form is only accepted as 1, every layer MoE)"
    )


def no_effect_warning(keys: list[str]) -> str:
    """The one warning line listing keys that are accepted but change nothing."""
    return (
        "these NeMo-Aligner/Lightning keys have no effect here and are ignored: "
        + ", ".join(keys)
        + " (see docs/migrating_from_nemo_aligner.md)"
    )
