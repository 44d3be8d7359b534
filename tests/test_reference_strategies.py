"""The reference strategies (`algorithms.reference_strategies`): one object per
`reference_policy`, chosen once from the config through one table.

CPU only, no process group: the strategies' run-specific steps are checked on plain modules;
the end-to-end runs of each strategy are in tests/test_e2e_*.py and tests/test_precomputed_reference.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from megatron_kto.algorithms.reference_strategies import (
    STRATEGIES,
    AdaptersOff,
    CPUSwap,
    NoReference,
    Precomputed,
    Separate,
    choose_reference,
)
from megatron_kto.checkpointing import files
from megatron_kto.checkpointing.errors import CheckpointError
from megatron_kto.config.schema import register
from megatron_kto.losses.dpo_types import NO_REFERENCE
from megatron_kto.models.reference import CPUSwapReference, SeparateReference
from megatron_kto.peft.reference import AdaptersOffReference
from megatron_kto.peft.settings import FULL_REFERENCES, LORA_REFERENCES

CONF = Path(__file__).resolve().parents[1] / "conf"


def _cfg(name: str, overrides: list[str]):
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def test_the_table_holds_every_strategy_the_config_accepts() -> None:
    # `none` is no user's choice: a reference-free loss type picks it (or an explicit `none`).
    assert set(STRATEGIES) == set(FULL_REFERENCES) | set(LORA_REFERENCES) | {NO_REFERENCE}
    for name, factory in STRATEGIES.items():
        assert factory.name == name


@pytest.mark.parametrize(
    ("config", "algorithm", "overrides", "expected"),
    [
        ("gpt_kto", "kto", [], CPUSwap),  # the default without LoRA
        ("gpt_kto", "kto", ["model.peft.peft_scheme=lora"], AdaptersOff),  # ... and with it
        ("gpt_kto", "kto", ["model.kto.reference_policy=separate"], Separate),
        ("gpt_kto", "kto", ["model.kto.reference_policy=precomputed"], Precomputed),
        ("gpt_dpo", "dpo", ["model.dpo.reference_policy=precomputed"], Precomputed),
        ("gpt_dpo", "dpo", ["model.dpo.reference_policy=separate"], Separate),
        ("gpt_dpo", "dpo", ["model.dpo.loss_type=simpo"], NoReference),
        ("gpt_dpo", "dpo", ["model.dpo.loss_type=[cpo,orpo]"], NoReference),
        # A stated reference is not used by a reference-free loss (prepare notes it).
        ("gpt_dpo", "dpo", ["model.dpo.loss_type=orpo", "model.dpo.reference_policy=separate"],
         NoReference),
        ("gpt_dpo", "dpo", ["model.dpo.loss_type=cpo", "model.peft.peft_scheme=lora"], NoReference),
    ],
)  # fmt: skip
def test_choose_reference_reads_the_algorithms_key(config, algorithm, overrides, expected) -> None:
    assert type(choose_reference(_cfg(config, overrides), algorithm)) is expected


def test_only_precomputed_indexes_the_examples() -> None:
    cfg = _cfg("gpt_kto", [])
    for name, factory in STRATEGIES.items():
        strategy = factory(cfg, "kto")
        expected = 7 if name == "precomputed" else None
        assert strategy.index_offset(7) == expected, name


def _chunks(seed: int) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    return [torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)]


def test_separate_holds_a_frozen_copy_of_the_policy_built_before_ddp() -> None:
    strategy = Separate(_cfg("gpt_kto", []), "kto")
    policy = _chunks(0)
    built = []
    strategy.before_ddp(policy, lambda: built.append(_chunks(1)) or built[-1])
    reference = strategy.after_ddp(policy)
    assert isinstance(reference, SeparateReference) and len(built) == 1
    for p, r in zip(policy, built[0], strict=True):
        torch.testing.assert_close(r.weight, p.weight)
        assert not r.weight.requires_grad and not r.training
    with torch.no_grad():
        policy[0].weight.add_(1.0)  # training the policy leaves the copy as it was
    assert not torch.equal(policy[0].weight, built[0][0].weight)


def test_strategies_over_the_policy_chunks_build_nothing() -> None:
    cfg = _cfg("gpt_kto", [])
    never = lambda: pytest.fail("built a second model")  # noqa: E731
    for factory, policy_type in ((CPUSwap, CPUSwapReference), (AdaptersOff, AdaptersOffReference)):
        strategy = factory(cfg, "kto")
        policy = _chunks(0)
        strategy.before_ddp(policy, never)
        assert isinstance(strategy.after_ddp(policy), policy_type)
    precomputed = Precomputed(cfg, "kto")
    precomputed.before_ddp(_chunks(0), never)
    assert precomputed.after_ddp(_chunks(0)) is None  # attached by `before_training`


def test_no_reference_builds_nothing_and_refuses_a_reference_pass() -> None:
    strategy = NoReference(_cfg("gpt_dpo", ["model.dpo.loss_type=simpo"]), "dpo")
    strategy.before_ddp(_chunks(0), lambda: pytest.fail("built a second model"))
    policy = strategy.after_ddp(_chunks(0))
    assert strategy.index_offset(0) is None  # no table to index
    strategy.check_resume(None)
    with pytest.raises(RuntimeError, match="simpo is reference-free: no reference pass"):
        policy.log_probs({}, lambda chunks: pytest.fail("ran a reference forward"))


def test_the_policys_own_initialisation_must_be_rebuildable_on_resume(tmp_path) -> None:
    """Every strategy that rebuilds the initial weights refuses a random initialisation resumed
    under another pipeline layout; the precomputed table is read back instead, and `none` has
    nothing to rebuild."""
    files.write_json(
        tmp_path / files.CHECKPOINT_META,
        {"step": 3, "layout": {"pipeline_model_parallel_size": 1}},
    )
    cfg = _cfg("gpt_kto", ["model.pipeline_model_parallel_size=2"])
    for name, factory in STRATEGIES.items():
        strategy = factory(cfg, "kto")
        if name in ("precomputed", NO_REFERENCE):
            strategy.check_resume(tmp_path)
            continue
        with pytest.raises(CheckpointError, match="saved with PP=1, resuming with PP=2"):
            strategy.check_resume(tmp_path)
        strategy.check_resume(None)  # no checkpoint loaded: nothing to compare
