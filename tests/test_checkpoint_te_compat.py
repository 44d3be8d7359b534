"""Checkpoints load across layer specs: Transformer Engine (GPU) <-> megatron-core's local spec.

Transformer Engine cannot be imported here, but megatron-core's description of a TE model can:
its TE layer spec (`get_gpt_layer_with_transformer_engine_spec`, built with the TE spec provider
megatron-core skipped only because `import transformer_engine` failed, at the TE version the
image ships — the Dockerfile's `NGC_TRANSFORMER_ENGINE`), the TE module names it uses
(`extensions/transformer_engine.py`), the TE checkpoint names in its own keys map (the fused-MLP
`sharded_state_dict_keys_map`: `linear_fc1.layer_norm_weight`, ...), and the `sharded_state_dict`
methods of its TE classes, run here from megatron-core's source on CPU. From those the keys a TE
model of our architecture writes are derived, and compared with what our local-spec model writes
and what `checkpointing/spec_compat.py` tolerates (`_extra_state` entries only). The checkpoints
then really load both ways through `spec_compat` and megatron's dist_checkpointing. If
megatron-core renames anything on the TE side, these tests fail.

What only TE itself can show — a TE model's checkpoint resuming in the local spec and back — is
the `te_local_checkpoint` check of `tools/gpu_acceptance.sh`.

Facts of TE's own (not derivable without it; from its sources): its modules keep an
`_extra_state` entry in their module state dict (an empty uint8 tensor unless FP8 is used);
`TENorm` is TE's `RMSNorm`/`LayerNorm` with parameters `weight` (and `bias`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multirank import run_multirank
from te_standin import TE_EMPTY_EXTRA_STATE, image_te_version, real_method, te_spec

pytestmark = pytest.mark.multirank


class _TEModuleState:
    """`self` for a TE class's real `sharded_state_dict`: the module state TE keeps."""

    def __init__(self, state: dict, tp_group, config=None) -> None:
        self._state, self._tp_group, self.config = state, tp_group, config

    def state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict:
        return dict(self._state)


def _te_layout(te_version: str, arch) -> dict:
    """Per layer-spec path: megatron's TE class name and the sharded keys it writes, derived."""
    from megatron.core import parallel_state
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import sharded_state_dict_default

    spec, te_ext = te_spec(te_version)
    classes = {
        getattr(te_ext, name): name
        for name in ("TELayerNormColumnParallelLinear", "TERowParallelLinear",
                     "TEColumnParallelLinear", "TEDotProductAttention")
    }  # fmt: skip
    sub = spec.submodules
    paths = {
        "input_layernorm": sub.input_layernorm,
        "pre_mlp_layernorm": sub.pre_mlp_layernorm,
        **{f"self_attention.{k}": getattr(sub.self_attention.submodules, k)
           for k in ("linear_qkv", "core_attention", "linear_proj")},
        **{f"mlp.{k}": getattr(sub.mlp.submodules, k) for k in ("linear_fc1", "linear_fc2")},
    }  # fmt: skip
    # TE's parameter names per module, as megatron-core's fused-MLP keys map names them.
    te_names: dict[str, set[str]] = {}
    for target in sub.sharded_state_dict_keys_map.values():
        module, name = target.rsplit(".", 1)
        te_names.setdefault(module, set()).add(name)
    names_of = {
        classes[paths["mlp.linear_fc1"]]: te_names["mlp.linear_fc1"],
        classes[paths["mlp.linear_fc2"]]: te_names["mlp.linear_fc2"],
    }
    kept = {"weight", "layer_norm_weight"}  # our tiny architecture: RMSNorm, no biases
    tp_group = parallel_state.get_tensor_model_parallel_group()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    out: dict = {"classes": {}, "keys": set(), "te_names": te_names}
    for path, cls in paths.items():
        if cls is IdentityOp:
            out["classes"][path] = "IdentityOp"
            continue
        name = classes[cls]
        out["classes"][path] = name
        params = {n: torch.zeros(2, 2) for n in names_of.get(name, set()) & kept}
        state = _TEModuleState({**params, "_extra_state": TE_EMPTY_EXTRA_STATE}, tp_group, config)
        sharded = real_method(te_ext, name)(
            state, f"decoder.layers.{path}.", (), {"dp_cp_group": None}
        )
        out["keys"] |= {v.key for v in sharded.values()}

    class _TENormModuleState(torch.nn.Module):  # TE's RMSNorm: weight + extra state
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2))

        def get_extra_state(self):
            return TE_EMPTY_EXTRA_STATE

    norm = sharded_state_dict_default(_TENormModuleState(), "decoder.final_layernorm.")
    out["keys"] |= {v.key for v in norm.values()}
    return out


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
    from test_checkpoint_harness import build_run, tiny_arch
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_kto.checkpointing.errors import CheckpointError
    from megatron_kto.checkpointing.model_io import save_model
    from megatron_kto.checkpointing.spec_compat import load_module_state, load_sharded
    from megatron_kto.models.builder import unwrap
    from megatron_kto.models.layer_specs import local_layer_spec
    from megatron_kto.runtime import teardown

    root = Path(tmp)
    run = build_run(1, 1, seed=1)
    model = unwrap(run.chunks[0])
    te = _te_layout(image_te_version(), tiny_arch())
    local_sharded = model.sharded_state_dict()
    out = {
        "te": te,
        "local_keys": {v.key for v in local_sharded.values()},
        "local_keys_map": local_layer_spec(
            "RMSNorm", "sdpa"
        ).submodules.sharded_state_dict_keys_map,
    }
    te_only = sorted(te["keys"] - out["local_keys"])

    def te_extra(key: str) -> ShardedObject:  # as a TE model requests it (megatron's helper)
        return make_sharded_object_for_checkpoint(TE_EMPTY_EXTRA_STATE, key)

    # local checkpoint -> TE model: the TE-only objects are requested but absent.
    (root / "local").mkdir()
    save_model(root / "local", run.chunks, run.arch)
    request = {**model.sharded_state_dict(), **{k: te_extra(k) for k in te_only}}
    loaded = load_sharded(request, root / "local")
    out["local_to_te_loaded"] = sorted(k for k in loaded if k in te_only)
    out["local_to_te_weights_equal"] = all(
        torch.equal(loaded[k], v)
        for k, v in unwrap(run.chunks[0]).state_dict().items()
        if k in loaded and isinstance(v, torch.Tensor) and "_extra_state" not in k
    )
    try:  # without spec_compat's handling the default strictness fails on them
        dist_checkpointing.load(
            {**model.sharded_state_dict(), **{k: te_extra(k) for k in te_only}},
            str(root / "local"),
        )
        out["default_load"] = "ok"
    except (Exception, CheckpointException) as e:  # torch's is a BaseException
        out["default_load"] = f"{type(e).__name__}: {e}"
    # TE checkpoint (with its objects) -> local model: the extra objects are ignored.
    (root / "te").mkdir()
    dist_checkpointing.save(
        {**model.sharded_state_dict(), **{k: te_extra(k) for k in te_only}}, str(root / "te")
    )
    loaded = load_sharded(model.sharded_state_dict(), root / "te")
    out["te_to_local_not_loaded"] = sorted(set(model.sharded_state_dict()) - set(loaded))
    # A TE tensor the checkpoint lacks (a LayerNorm model's fused norm bias) is an error.
    missing = "decoder.layers.self_attention.linear_qkv.layer_norm_bias"
    try:
        load_sharded(
            {**model.sharded_state_dict(),
             "bias": ShardedTensor.from_rank_offsets(missing, torch.zeros(2, 32))},
            root / "local",
        )  # fmt: skip
        out["missing_tensor"] = "no error"
    except CheckpointError as e:
        out["missing_tensor"] = str(e)
    # Module state: TE's extra entries (sharded or not: TEDotProductAttention keeps one in its
    # module state only) are accepted, a missing weight is not.
    state = dict(model.state_dict())
    extra = {f"decoder.layers.{i}.self_attention.core_attention._extra_state": TE_EMPTY_EXTRA_STATE
             for i in range(len(model.decoder.layers))}  # fmt: skip
    extra["decoder.final_layernorm._extra_state"] = TE_EMPTY_EXTRA_STATE
    load_module_state(model, {**state, **extra}, "te state")
    try:
        load_module_state(model, {k: v for k, v in state.items() if "fc2.weight" not in k}, "x")
        out["module_missing"] = "no error"
    except CheckpointError as e:
        out["module_missing"] = str(e)
    teardown()
    return out


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    return run_multirank(_worker, 1, str(tmp_path_factory.mktemp("te_compat")), timeout=300)[0]


def test_te_spec_is_the_layout_spec_compat_assumes(result) -> None:
    """The TE layer spec fuses the pre-attention / pre-MLP norms into the QKV / fc1 linears
    (its norm slots are IdentityOp), the linears and attention are megatron's TE classes."""
    assert result["te"]["classes"] == {
        "input_layernorm": "IdentityOp",
        "pre_mlp_layernorm": "IdentityOp",
        "self_attention.linear_qkv": "TELayerNormColumnParallelLinear",
        "self_attention.core_attention": "TEDotProductAttention",
        "self_attention.linear_proj": "TERowParallelLinear",
        "mlp.linear_fc1": "TELayerNormColumnParallelLinear",
        "mlp.linear_fc2": "TERowParallelLinear",
    }


def test_local_spec_renames_its_norms_to_the_te_fused_names(result) -> None:
    """Each norm the local spec renames lands on a TE fused linear's `layer_norm_*` names, as
    megatron-core's own TE keys map names them."""
    te = result["te"]
    for local_prefix, target in result["local_keys_map"].items():
        module = target.removesuffix(".layer_norm_")
        assert te["classes"][module] == "TELayerNormColumnParallelLinear", target
        assert te["classes"][local_prefix.rstrip(".")] == "IdentityOp", local_prefix
        if module in te["te_names"]:
            assert {"layer_norm_weight", "layer_norm_bias"} <= te["te_names"][module]


def test_tensor_keys_agree_and_only_extra_state_differs(result) -> None:
    from megatron_kto.checkpointing.spec_compat import _is_extra_state

    te_keys = result["te"]["keys"]
    decoder_local = {k for k in result["local_keys"] if k.startswith("decoder.")}
    assert {k for k in te_keys if not _is_extra_state(k)} == {
        k for k in decoder_local if not _is_extra_state(k)
    }
    assert decoder_local - te_keys == set()
    # The one TE-only entry: the final TE norm's extra state (spec_compat's docstring).
    assert te_keys - decoder_local == {"decoder.final_layernorm._extra_state"}
    assert all(_is_extra_state(k) for k in te_keys ^ decoder_local)


def test_local_checkpoint_loads_into_a_te_request(result) -> None:
    assert result["local_to_te_loaded"] == []  # absent, tolerated, not invented
    assert result["local_to_te_weights_equal"]
    assert result["default_load"] != "ok"  # why spec_compat exists: default strictness fails


def test_te_checkpoint_loads_into_the_local_model(result) -> None:
    assert result["te_to_local_not_loaded"] == []


def test_a_really_missing_tensor_is_one_clear_error(result) -> None:
    message = result["missing_tensor"]
    assert "linear_qkv.layer_norm_bias" in message and "\n" not in message, message
    assert "linear_fc2.weight" in result["module_missing"], result["module_missing"]
