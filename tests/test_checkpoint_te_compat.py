"""Checkpoints move between the Transformer Engine layer spec and the local spec (2 ranks).

Transformer Engine cannot be imported here, so a local-spec model is given what the TE spec adds
to its state, as megatron-core 0.16.1 + TE 2.x produce it (`checkpointing/spec_compat.py` lists
the differences and the megatron-core sources): TE's empty-uint8 `_extra_state` (FP8-like bytes
for an FP8 run) on the four linear layers of each block, where megatron's linears store `None`;
a final norm with `_extra_state` in both its module and its sharded state dict (`TENorm`); and a
core attention with `_extra_state` in its module state dict only (`TEDotProductAttention`).
Checkpoint keys of the norms need no simulation: the local spec already writes TE's names
(asserted below).

Scenarios, each in both directions (local -> TE-style, TE-style -> local): model-only loads
(conversion output / `restore_from_path`) across TP=2 -> TP=1 x DP=2, and training resumes whose
next step must equal the source run's own next step bit for bit. A checkpoint that lacks a real
weight must still fail, in one line naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multirank import run_multirank

pytestmark = pytest.mark.multirank

TRAINER_STATE = {"epoch": 0, "consumed_samples": 8}
#: What an FP8 run's TE module serialises (any bytes: the local spec must ignore them).
FP8_LIKE = torch.frombuffer(bytearray(b"fp8-scaling-state"), dtype=torch.uint8)


class _TEExtraState:
    """Extra state the way Transformer Engine 2.x modules have it (mixin for a class swap)."""

    te_payload = torch.empty(0, dtype=torch.uint8)  # TE without FP8: an empty uint8 tensor

    def get_extra_state(self):
        return self.te_payload.clone()

    def set_extra_state(self, state):
        # TE returns early on None / an empty tensor; record what arrived.
        self.te_loaded = state


class _TEAttentionExtraState(_TEExtraState):
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        # TEDotProductAttention.sharded_state_dict: nothing unless the softmax is learnable.
        return {}


def te_style(model: torch.nn.Module, payload: torch.Tensor = FP8_LIKE) -> torch.nn.Module:
    """Give a local-spec GPTModel (unwrapped) the state Transformer Engine's spec has."""

    def swap(module: torch.nn.Module, mixin: type) -> None:
        cls = module.__class__
        module.__class__ = type(f"TE{cls.__name__}", (mixin, cls), {})
        module.te_payload = payload

    for layer in model.decoder.layers:
        for linear in (
            layer.self_attention.linear_qkv,
            layer.self_attention.linear_proj,
            layer.mlp.linear_fc1,
            layer.mlp.linear_fc2,
        ):
            swap(linear, _TEExtraState)
        swap(layer.self_attention.core_attention, _TEAttentionExtraState)
    if getattr(model.decoder, "final_layernorm", None) is not None:
        swap(model.decoder.final_layernorm, _TEExtraState)
    return model


def _params(chunks) -> dict[str, torch.Tensor]:
    from megatron_kto.models.builder import unwrap

    return {
        f"{i}.{n}": p.detach().clone()
        for i, c in enumerate(chunks)
        for n, p in unwrap(c).named_parameters()
    }


def _model_only(root: Path) -> dict:
    """Weights saved at TP=2 by one spec load at TP=1 x DP=2 into the other, and make it back."""
    from test_checkpoint_harness import build_run

    from megatron_kto.checkpointing.errors import CheckpointError
    from megatron_kto.checkpointing.model_io import load_model, save_model
    from megatron_kto.models.builder import unwrap

    out = {}
    for name, source_te in (("local_to_te", False), ("te_to_local", True)):
        src = build_run(2, 1, seed=1)
        if source_te:
            te_style(unwrap(src.chunks[0]))
        (root / name).mkdir(parents=True, exist_ok=True)
        save_model(root / name, src.chunks, src.arch)
        expected = _params(src.chunks)

        dst = build_run(1, 1, seed=9)
        if not source_te:
            te_style(unwrap(dst.chunks[0]))
        error = ""
        try:
            load_model(root / name, dst.chunks)
        except CheckpointError as e:
            error = str(e)
        # Back at TP=2 in the source spec, through a checkpoint written by the other spec.
        (root / f"{name}_back").mkdir(exist_ok=True)
        save_model(root / f"{name}_back", dst.chunks, dst.arch)
        back = build_run(2, 1, seed=5)
        if source_te:
            te_style(unwrap(back.chunks[0]))
        load_model(root / f"{name}_back", back.chunks)
        got = _params(back.chunks)
        dst_model = unwrap(dst.chunks[0])
        out[name] = {
            "error": error,
            "round_trip_equal": all(torch.equal(got[k], v) for k, v in expected.items()),
            "final_norm_extra": getattr(dst_model.decoder.final_layernorm, "te_loaded", "kept"),
            "qkv_extra": getattr(
                dst_model.decoder.layers[0].self_attention.linear_qkv, "te_loaded", "kept"
            ),
        }
    return out


def _resume(root: Path, source_te: bool) -> dict:
    """A training checkpoint of one spec resumes in the other; the next step is bit-identical."""
    from test_checkpoint_harness import build_run

    from megatron_kto.checkpointing.manager import CheckpointManager
    from megatron_kto.models.builder import unwrap

    src = build_run(1, 1, True, seed=1, dropout=0.1)
    if source_te:
        te_style(unwrap(src.chunks[0]))
    src.step(1)
    src.step(2)
    CheckpointManager(root).save(
        2, src.chunks, src.optimizer, src.scheduler, TRAINER_STATE, "", src.arch
    )
    src.step(3)
    expected = _params(src.chunks)

    dst = build_run(1, 1, True, seed=7, dropout=0.1)
    if not source_te:
        te_style(unwrap(dst.chunks[0]))
    state = CheckpointManager(root).load_latest(dst.chunks, dst.optimizer, dst.scheduler)
    dst.step(3)
    got = _params(dst.chunks)
    return {
        "step": state["step"],
        "equal": all(torch.equal(got[k], v) for k, v in expected.items()),
    }


def _missing_weight(root: Path) -> str:
    """A tied-embedding checkpoint has no output layer; an untied model must refuse it."""
    from test_checkpoint_harness import build_run, tiny_arch

    from megatron_kto.checkpointing.errors import CheckpointError
    from megatron_kto.checkpointing.model_io import load_model, save_model
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks

    run = build_run(1, 1, seed=1)
    tied = tiny_arch()
    tied.share_embeddings_and_output_weights = True
    chunks = build_gpt_chunks(tied, ParallelLayout(), torch.device("cpu"))
    (root / "tied").mkdir(parents=True, exist_ok=True)
    save_model(root / "tied", chunks, tied)
    try:
        load_model(root / "tied", run.chunks)
    except CheckpointError as e:
        return str(e)
    return "no error"


def _local_spec_writes_te_names() -> list[str]:
    from test_checkpoint_harness import build_run

    from megatron_kto.models.builder import unwrap

    run = build_run(1, 1, seed=1)
    return sorted(
        {
            v.key
            for k, v in unwrap(run.chunks[0]).sharded_state_dict().items()
            if "layernorm" in k and "final" not in k
        }
    )


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    from megatron_kto.runtime import teardown

    root = Path(tmp)
    out = {
        "model_only": _model_only(root / "model_only"),
        "resume_local_to_te": _resume(root / "resume_l2t", source_te=False),
        "resume_te_to_local": _resume(root / "resume_t2l", source_te=True),
        "missing_weight": _missing_weight(root / "missing"),
        "norm_keys": _local_spec_writes_te_names(),
    }
    teardown()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_multirank(_worker, 2, str(tmp_path_factory.mktemp("te_compat")), timeout=400)


def test_local_spec_writes_transformer_engine_norm_names(results) -> None:
    assert results[0]["norm_keys"] == [
        "decoder.layers.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
    ]


@pytest.mark.parametrize("direction", ["local_to_te", "te_to_local"])
def test_model_only_checkpoint_loads_in_the_other_spec(results, direction) -> None:
    for r in results:
        got = r["model_only"][direction]
        assert got["error"] == "", got["error"]
        assert got["round_trip_equal"]
    if direction == "local_to_te":
        # The TE-style final norm found no extra state in the checkpoint and kept its own; its
        # linears received megatron's empty (None) extra state, on which TE returns early.
        got = results[0]["model_only"][direction]
        assert got["final_norm_extra"] == "kept" and got["qkv_extra"] is None


@pytest.mark.parametrize("direction", ["resume_local_to_te", "resume_te_to_local"])
def test_training_checkpoint_resumes_in_the_other_spec(results, direction) -> None:
    for r in results:
        assert r[direction] == {"step": 2, "equal": True}


def test_a_really_missing_weight_is_one_clear_error(results) -> None:
    message = results[0]["missing_weight"]
    assert "output_layer.weight" in message and "\n" not in message, message
