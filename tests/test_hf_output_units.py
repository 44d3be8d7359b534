"""The pieces of the in-training Hugging Face output that need no model run: its config keys,
the atomic replacement of the output directory, and converting a model part by part."""

from __future__ import annotations

import pytest
import torch

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.config.validate import ConfigError
from megatron_kto.conversion.mappings import to_hf, to_megatron
from megatron_kto.entry import compose_run_config
from megatron_kto.hf_writer.output import _recover, _replace


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["exp_manager.save_hf_every_save=true"], "exp_manager.save_hf_every_save"),
        (
            ["exp_manager.save_hf=true", "exp_manager.save_hf_merged=true"],
            "exp_manager.save_hf_merged",
        ),
        (["exp_manager.save_hf_merged=true"], "exp_manager.save_hf_merged"),
        (
            ["exp_manager.save_hf=true", "exp_manager.save_hf_max_shard_mb=0"],
            "exp_manager.save_hf_max_shard_mb",
        ),
    ],
)
def test_inconsistent_keys_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        compose_run_config("gpt_kto", overrides, "kto", world_size=1)
    message = str(info.value)
    assert message.startswith(f"{key}:") and "\n" not in message, message


def test_the_keys_validate_when_consistent():
    overrides = [
        "exp_manager.save_hf=true",
        "exp_manager.save_hf_every_save=true",
        "exp_manager.save_hf_merged=true",
        "model.peft.peft_scheme=lora",
    ]
    prepared = compose_run_config("gpt_kto", overrides, "kto", world_size=1)
    assert prepared.cfg.exp_manager.save_hf_merged is True


def _directory(path, text):
    path.mkdir()
    (path / "weights").write_text(text)


def test_replace_swaps_in_the_new_directory(tmp_path):
    final, tmp = tmp_path / "hf", tmp_path / "hf.tmp"
    _directory(final, "old")
    _directory(tmp, "new")
    _replace(tmp, final)
    assert (final / "weights").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_recover_puts_back_the_previous_directory_after_a_crash_between_renames(tmp_path):
    final, old = tmp_path / "hf", tmp_path / "hf.old"
    _directory(old, "previous")  # `hf` was moved aside, the new one never renamed in
    _recover(final)
    assert (final / "weights").read_text() == "previous" and not old.exists()
    _directory(old, "stale")  # both exist: `hf` is the newer, complete one
    _recover(final)
    assert (final / "weights").read_text() == "previous" and not old.exists()


@pytest.mark.parametrize("tied", [False, True])
def test_converting_stage_by_stage_gives_the_whole_model(tied):
    """Each pipeline stage converts its own layers (and the ends it holds): the union of the
    parts is the whole conversion, tensor for tensor."""
    arch = GPTArchitecture(
        num_layers=4,
        hidden_size=16,
        ffn_hidden_size=24,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=50,
        share_embeddings_and_output_weights=tied,
    )
    gen = torch.Generator().manual_seed(0)
    names = set()
    hf = {}

    def get_hf(name: str) -> torch.Tensor:
        names.add(name)
        return hf.setdefault(name, torch.randn(_shape(name, arch), generator=gen))

    megatron = dict(to_megatron(get_hf, arch, 64))
    whole = dict(to_hf(megatron.__getitem__, arch))
    stages = [
        dict(to_hf(megatron.__getitem__, arch, layers=[0, 1], embedding=True, head=False)),
        dict(to_hf(megatron.__getitem__, arch, layers=[2, 3], embedding=False, head=True)),
    ]
    assert not stages[0].keys() & stages[1].keys()
    parts = {**stages[0], **stages[1]}
    assert parts.keys() == whole.keys() == names
    assert all(torch.equal(parts[k], whole[k]) and torch.equal(parts[k], hf[k]) for k in whole)


def _shape(name: str, arch: GPTArchitecture) -> tuple[int, ...]:
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.hidden_size // arch.num_attention_heads
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return (arch.vocab_size, h)
    if name.endswith("norm.weight"):
        return (h,)
    if name.endswith(("k_proj.weight", "v_proj.weight")):
        return (arch.num_query_groups * d, h)
    if name.endswith(("q_proj.weight", "o_proj.weight")):
        return (h, h)
    if name.endswith("down_proj.weight"):
        return (h, f)
    return (f, h)  # gate_proj, up_proj
