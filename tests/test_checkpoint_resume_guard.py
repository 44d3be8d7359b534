"""A resume whose reference policy could not be rebuilt is refused, in one line.

Training checkpoints do not hold the reference policy; a resumed run rebuilds it from
`pretrained_checkpoint.restore_from_path` or, without one, from the seeded random
initialisation — which depends on the pipeline layout (`tests/test_e2e_resume.py` resumes a
run that has a starting checkpoint under another PP and matches; without one the reference
policy of the resumed run differed and every reward after the resume was wrong).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from megatron_kto.checkpointing import files
from megatron_kto.checkpointing.errors import CheckpointError
from megatron_kto.config.schema import register
from megatron_kto.run import _check_reference_reproducible

CONF = Path(__file__).resolve().parents[1] / "conf"


def _cfg(overrides: list[str]):
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="gpt_kto", overrides=overrides)


def _checkpoint(tmp_path: Path, pp: int, vpp: int | None) -> Path:
    ckpt = tmp_path / "step_3"
    ckpt.mkdir()
    layout = {
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vpp,
        "tensor_model_parallel_size": 1,
    }
    files.write_json(ckpt / files.CHECKPOINT_META, {"step": 3, "layout": layout})
    return ckpt


def test_random_init_resumed_under_another_pp_is_refused(tmp_path) -> None:
    ckpt = _checkpoint(tmp_path, pp=1, vpp=None)
    with pytest.raises(CheckpointError) as e:
        _check_reference_reproducible(_cfg(["model.pipeline_model_parallel_size=2"]), "kto", ckpt)
    message = str(e.value)
    assert "\n" not in message
    assert "saved with PP=1, resuming with PP=2" in message
    assert message.endswith("resume with model.pipeline_model_parallel_size=1")


def test_vpp_is_part_of_the_layout(tmp_path) -> None:
    ckpt = _checkpoint(tmp_path, pp=2, vpp=2)
    with pytest.raises(CheckpointError, match="virtual_pipeline_model_parallel_size=2$"):
        _check_reference_reproducible(_cfg(["model.pipeline_model_parallel_size=2"]), "kto", ckpt)


def test_the_uneven_pipeline_split_is_part_of_the_layout(tmp_path) -> None:
    """An uneven split (model.num_layers_in_first/last_pipeline_stage, read from the saved
    config.yaml) places layers on other stages: resuming it evenly at the same PP is refused,
    and so is the reverse."""
    ckpt = _checkpoint(tmp_path, pp=2, vpp=None)
    uneven = ["model.pipeline_model_parallel_size=2", "model.num_layers_in_first_pipeline_stage=1"]
    (ckpt / files.CONFIG).write_text("model:\n  num_layers_in_first_pipeline_stage: 1\n")
    _check_reference_reproducible(_cfg(uneven), "kto", ckpt)  # the same split
    with pytest.raises(CheckpointError) as e:
        _check_reference_reproducible(_cfg(uneven[:1]), "kto", ckpt)
    assert "first/last stage layers 1/None, resuming with PP=2;" in str(e.value)
    assert str(e.value).endswith("model.num_layers_in_first_pipeline_stage=1")
    (ckpt / files.CONFIG).unlink()  # saved evenly (or before the keys existed)
    with pytest.raises(CheckpointError, match="num_layers_in_first_pipeline_stage=null$"):
        _check_reference_reproducible(_cfg(uneven), "kto", ckpt)


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # same pipeline layout (TP/DP changes keep the initialisation)
        ["model.tensor_model_parallel_size=2"],
        ["model.pipeline_model_parallel_size=2", "pretrained_checkpoint.restore_from_path=/x"],
        ["model.pipeline_model_parallel_size=2", "model.kto.reference_policy=precomputed"],
    ],
)
def test_reproducible_references_pass(tmp_path, overrides) -> None:
    _check_reference_reproducible(_cfg(overrides), "kto", _checkpoint(tmp_path, pp=1, vpp=None))


def test_layouts_saved_before_the_expert_keys_read_as_their_defaults() -> None:
    """checkpoint.json written before EP / expert TP were recorded: EP was 1 and expert TP was
    the attention's TP (megatron-core's default), so such a layout still compares equal to the
    same layout recorded today (and its RNG states are restored)."""
    from megatron_kto.checkpointing.manager import _describe, _saved

    old = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
    assert _saved(old, "expert_model_parallel_size") == 1
    assert _saved(old, "expert_tensor_parallel_size") == 2
    assert _saved(old | {"expert_tensor_parallel_size": 1}, "expert_tensor_parallel_size") == 1
    assert "ETP" not in _describe(old, "standard")
    etp1 = old | {"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}
    assert "EP=2 ETP=1" in _describe(etp1, "standard")
