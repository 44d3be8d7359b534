"""Which layers each pipeline stage (and each of its model chunks) builds, even or uneven.

megatron-core 0.16.1 splits `num_layers` evenly over PP (x VPP) unless
`num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage` are set: then the
first (last) stage holds that many layers and the rest split evenly over the middle stages
(DeepSeek-V3's 61 layers at PP16: 4 + 14 x 4 + 1, say). Every place that needs a stage's layers
(the layout checks, the memory plan) asks megatron-core's own `get_transformer_layer_offset` /
`get_num_layers_to_build` here, so there is one formula; the model itself gets them from its
TransformerConfig, and weight addressing reads each built layer's global `layer_number`.
"""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

from megatron_kto.config.errors import need

__all__ = ["check_pipeline_split", "chunk_layers", "chunk_sizes"]

FIRST_KEY = "model.num_layers_in_first_pipeline_stage"
LAST_KEY = "model.num_layers_in_last_pipeline_stage"


def _config(num_layers: int, pp: int, vpp: int | None, first: int | None, last: int | None):
    """The TransformerConfig fields megatron-core's split functions read."""
    return SimpleNamespace(
        num_layers=num_layers,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        pipeline_model_parallel_layout=None,
        account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
    )


@functools.lru_cache(maxsize=4096)  # the layout planner asks for the same chunks many times
def chunk_layers(
    num_layers: int,
    pp: int,
    vpp: int | None,
    pp_rank: int,
    vp_stage: int = 0,
    first: int | None = None,
    last: int | None = None,
) -> range:
    """Global indices (0-based) of the layers of pipeline rank `pp_rank`'s chunk `vp_stage`."""
    with warnings.catch_warnings():  # its import notes (no Transformer Engine, ...): not ours
        warnings.simplefilter("ignore")
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = _config(num_layers, pp, vpp, first, last)
    vp = vp_stage if vpp else None
    start = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=pp_rank)
    return range(start, start + get_num_layers_to_build(config, vp_stage=vp, pp_rank=pp_rank))


def chunk_sizes(
    num_layers: int, pp: int, vpp: int | None, first: int | None, last: int | None
) -> list[int]:
    """Layers of every model chunk, pipeline rank by rank (a valid split: see the check)."""
    return [
        len(chunk_layers(num_layers, pp, vpp, rank, stage, first, last))
        for rank in range(pp)
        for stage in range(vpp or 1)
    ]


def check_pipeline_split(
    num_layers: int,
    pp: int,
    vpp: int | None,
    first: int | None,
    last: int | None,
    where: str = "",
) -> None:
    """The layers split over the pipeline as megatron-core 0.16.1 accepts (its
    TransformerConfig checks, said with our keys) when first/last are set: the layers left after
    the first (last) stage's split evenly over the middle stages, and with VPP every stage's
    count divides into VPP chunks. (The even split is `layout.check_layout`'s.)

    Raises:
        ConfigError: naming the key.
    """
    chunks = vpp or 1
    if first is None and last is None:
        return
    for key, value in ((FIRST_KEY, first), (LAST_KEY, last)):
        if value is None:
            continue
        need(value >= 1, key, f"must be >= 1 (or null for an even split), got {value}")
        need(pp > 1, key, f"needs pipeline_model_parallel_size > 1, got {pp}")
        need(
            value % chunks == 0,
            key,
            f"{value} layers do not split into the {chunks} model chunks of a stage (VPP)",
        )
    middle_stages = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    split = f"{num_layers} layers - first {first} - last {last} = {middle}"
    if middle_stages == 0:
        need(
            middle == 0,
            LAST_KEY if last is not None else FIRST_KEY,
            f"{split} left over with no middle stage{where}; must be 0",
        )
        return
    need(
        middle > 0 and middle % middle_stages == 0,
        FIRST_KEY if first is not None else LAST_KEY,
        f"{split} do not split evenly over the {middle_stages} other pipeline stages{where}",
    )
    need(
        middle // middle_stages % chunks == 0,
        "model.virtual_pipeline_model_parallel_size",
        f"the {middle // middle_stages} layers of each middle stage do not split into {chunks} "
        "model chunks",
    )
