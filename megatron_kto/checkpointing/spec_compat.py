"""Checkpoints load across layer specs: Transformer Engine (GPU) <-> megatron-core's local spec.

A checkpoint converted or trained on a machine without Transformer Engine (every CPU box, a plain
`pip install`) must restore into a TE model, and a TE run's checkpoint into a local-spec model.
What differs between the two specs in megatron-core 0.16.1, and how each difference is handled:

* **Tensor names: none in the checkpoint.** TE fuses the pre-attention / pre-MLP norms into
  `linear_qkv` / `linear_fc1` (`...linear_qkv.layer_norm_weight`); the local spec keeps separate
  norm modules (`input_layernorm.weight`) but its `TransformerLayer` renames them to the TE keys
  in its sharded state dict (`sharded_state_dict_keys_map` in
  `gpt_layer_specs.get_gpt_layer_local_spec`), so both write the same dist-checkpoint keys.
  (In-process module names do differ; `conversion.addressing.norm_names` picks the right ones.)
* **`_extra_state` (TE's FP8 metadata).** TE linear layers store it as a `ShardedObject`, and so do
  megatron's own linear layers (an empty one), so those keys exist on both sides; only the values
  differ and each side accepts the other's (megatron's linears ignore extra state, TE returns
  early on `None` or an empty tensor). Two TE-only entries remain: the final `TENorm`
  (`decoder.final_layernorm._extra_state`, a TE 2.x op with extra state) is in TE's sharded state
  dict, and `TEDotProductAttention` keeps extra state in its module state dict but leaves it out
  of the sharded one — except with attention sinks (`softmax_type="learnable"`), where megatron-core
  shards its whole state dict: `core_attention.softmax_offset` (the same key and TP split as our
  `SDPAttention`'s) and `core_attention._extra_state`.

Loading local -> TE: the TE model requests `_extra_state` objects the checkpoint lacks. With
`dist_checkpointing.load`'s default `StrictHandling.ASSUME_OK_UNEXPECTED` the torch_dist reader
fails on them ("Missing key in checkpoint"); we load with `StrictHandling.RETURN_UNEXPECTED`,
under which megatron-core removes requested-but-absent ("unexpected") keys from the request and
returns them, and accept the absence of `_extra_state` keys only. Loading TE -> local: the
checkpoint's extra keys are "missing" in megatron-core's terms, which every `*_UNEXPECTED` mode
ignores. Module state dicts are then loaded non-strictly and checked: only `_extra_state` may be
absent (a TE module then keeps its fresh FP8 metadata, exactly what `set_extra_state(None)`
does) and nothing may be left over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.validation import StrictHandling

from megatron_kto.checkpointing.errors import CheckpointError

EXTRA_STATE = "_extra_state"


def _is_extra_state(key: str) -> bool:
    return key.rsplit(".", 1)[-1] == EXTRA_STATE


def _listing(keys: list[str], limit: int = 3) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def load_sharded(sharded_state_dict: dict[str, Any], ckpt_dir: str | Path) -> dict[str, Any]:
    """`dist_checkpointing.load` that tolerates `_extra_state` objects the checkpoint lacks.

    Args:
        sharded_state_dict: what this rank requests (model, optionally optimizer).
        ckpt_dir: the dist checkpoint.

    Returns:
        The loaded state dict (without the absent `_extra_state` entries).

    Raises:
        CheckpointError: the checkpoint lacks anything else this rank requested.
    """
    loaded, _, unexpected = dist_checkpointing.load(
        sharded_state_dict, str(ckpt_dir), strict=StrictHandling.RETURN_UNEXPECTED
    )
    absent = sorted(k for k in unexpected if not _is_extra_state(k))
    if absent:
        raise CheckpointError(
            f"{ckpt_dir}: lacks {len(absent)} tensor(s) this model needs: {_listing(absent)} — "
            "saved from a different architecture?"
        )
    return loaded


def load_module_state(module: torch.nn.Module, state: dict[str, Any], where: str) -> None:
    """`module.load_state_dict(state)`, strict except for `_extra_state` entries.

    Raises:
        CheckpointError: a parameter or buffer is missing, or `state` has entries the module
            does not know.
    """
    result = module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not _is_extra_state(k)]
    unexpected = [k for k in result.unexpected_keys if not _is_extra_state(k)]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected {_listing(unexpected)}")
        raise CheckpointError(f"{where}: weights do not fit the model ({'; '.join(parts)})")
