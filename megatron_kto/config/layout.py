"""The parallel layout fits the world and the architecture: TP/PP/VPP against heads, query groups,
embedding rows and layers; EP/ETP against the experts; DP from the world size.

Shared by the training config's `validate` and the eval tool's flags; each failure is a
`ConfigError` naming the key (or flag) to change.
"""

from __future__ import annotations

from typing import Any

from megatron_kto.config.errors import need
from megatron_kto.config.pipeline_split import check_pipeline_split

__all__ = ["check_expert_layout", "check_layout", "data_parallel_size"]


def data_parallel_size(cfg: Any, world_size: int) -> int:
    """DP degree implied by the world size and the model-parallel layout."""
    m = cfg.model
    cp = m.context_parallel_size
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * cp
    need(
        world_size % model_parallel == 0,
        "model.tensor_model_parallel_size",
        f"world size {world_size} is not divisible by TP ({m.tensor_model_parallel_size}) x "
        f"PP ({m.pipeline_model_parallel_size})" + (f" x CP ({cp})" if cp > 1 else ""),
    )
    return world_size // model_parallel


def check_layout(
    arch: Any,
    tp: int,
    pp: int,
    vpp: int | None,
    *,
    first: int | None = None,
    last: int | None = None,
    architecture_file: str | None = None,
    keys: tuple[str, str, str] = (
        "model.tensor_model_parallel_size",
        "model.pipeline_model_parallel_size",
        "model.virtual_pipeline_model_parallel_size",
    ),
) -> None:
    """The model-parallel layout fits the architecture (heads, query groups, layers).

    Args:
        arch: anything with the GPTArchitecture fields.
        tp, pp, vpp: the layout.
        first, last: layers of the first / last pipeline stage (None: the even split).
        architecture_file: where `arch` was read from (a checkpoint's architecture.json), or
            None when it is the config's own: the message then names the layout key the user
            can change and the file that fixes the shape, instead of the model.* key.
        keys: how the layout is spelt for the user (config keys, or a tool's flags).

    Raises:
        ConfigError: naming the key.
    """
    tp_key, pp_key, vpp_key = keys
    for key, value in ((tp_key, tp), (pp_key, pp)):
        need(value >= 1, key, f"must be >= 1, got {value}")
    groups = arch.num_query_groups or arch.num_attention_heads
    if architecture_file is not None:
        where = f" in {architecture_file}"
        need(
            arch.num_attention_heads % tp == 0,
            tp_key,
            f"{tp} does not divide the {arch.num_attention_heads} attention heads{where}",
        )
        need(groups % tp == 0, tp_key, f"{tp} does not divide the {groups} query groups{where}")
        rows = arch.padded_vocab_size
        need(
            rows is None or rows % tp == 0,
            tp_key,
            f"{tp} does not divide the {rows} embedding rows (padded_vocab_size){where}",
        )
        stages = pp * (vpp or 1)
        what = f"PP x VPP = {pp} x {vpp}" if vpp else str(pp)
        check_pipeline_split(arch.num_layers, pp, vpp, first, last, where)
        need(
            first is not None or last is not None or arch.num_layers % stages == 0,
            vpp_key if vpp else pp_key,
            f"{what} does not divide the {arch.num_layers} layers{where} (or set "
            "model.num_layers_in_first_pipeline_stage / _last_ for an uneven split)",
        )
        return
    need(
        arch.num_attention_heads % tp == 0,
        "model.num_attention_heads",
        f"{arch.num_attention_heads} heads not divisible by TP={tp}",
    )
    need(
        groups % tp == 0,
        "model.num_query_groups",
        f"{groups} query groups not divisible by TP={tp}",
    )
    if first is not None or last is not None:
        check_pipeline_split(arch.num_layers, pp, vpp, first, last)
    elif vpp is not None:
        need(
            arch.num_layers % (pp * vpp) == 0,
            "model.num_layers",
            f"{arch.num_layers} layers not divisible by PP x VPP = {pp * vpp}",
        )
    else:
        need(
            arch.num_layers % pp == 0,
            "model.num_layers",
            f"{arch.num_layers} layers not divisible by PP={pp} (or set "
            "model.num_layers_in_first_pipeline_stage / _last_ for an uneven split)",
        )


def check_expert_layout(
    arch: Any,
    ep: int,
    data_parallel: int,
    *,
    architecture_file: str | None = None,
    key: str = "model.expert_model_parallel_size",
    tp: int = 1,
    etp: int | None = None,
    etp_key: str = "model.expert_tensor_parallel_size",
) -> None:
    """The expert-parallel and expert-tensor-parallel degrees fit the layout and the architecture.

    megatron-core lays the MoE layers out on their own grid over the same world: ETP x EP x
    expert-DP x PP, where ETP (None: the attention's `tp`) splits each expert's linears and EP
    splits the experts. So `ep` must divide the expert count, `etp` the experts' hidden size, and
    ETP x EP the ranks of a pipeline stage (TP x `data_parallel`, which counts DP x CP); at
    ETP = TP that is: `ep` divides `data_parallel`. ETP != TP trains at EP = 1 too because
    `training_setup.mark_experts_expert_parallel` marks experts as expert parameters at every EP
    size (megatron-core 0.16.1 does so only at EP > 1, and would reduce EP = 1 experts' gradients
    over the dense data-parallel group: TP=2 x ETP=1 then trains to other weights than TP=1).

    Raises:
        ConfigError: naming `key` (EP) or `etp_key` (ETP).
    """
    need(ep >= 1, key, f"must be >= 1, got {ep}")
    need(etp is None or etp >= 1, etp_key, f"must be >= 1, got {etp}")
    etp = tp if etp is None else etp
    where = f" in {architecture_file}" if architecture_file else ""
    experts = arch.num_moe_experts
    if etp != tp:
        need(
            bool(experts),
            etp_key,
            f"{etp} (not TP={tp}) needs a mixture-of-experts model (num_moe_experts unset{where})",
        )
        hidden = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
        need(
            hidden % etp == 0,
            etp_key,
            f"{etp} does not divide the experts' hidden size {hidden} (moe_ffn_hidden_size{where})",
        )
        stage = tp * data_parallel
        need(
            stage % (etp * ep) == 0,
            etp_key,
            f"ETP x EP = {etp} x {ep} does not divide the {stage} ranks of a pipeline stage "
            f"(world / PP = TP x DP x CP); megatron-core tiles them with ETP x EP x expert-DP",
        )
    if ep == 1:
        return
    need(
        bool(experts), key, f"{ep} needs a mixture-of-experts model (num_moe_experts unset{where})"
    )
    need(
        experts % ep == 0,
        key,
        f"{ep} does not divide the {experts} experts (num_moe_experts{where})",
    )
    need(
        etp != tp or data_parallel % ep == 0,
        key,
        f"{ep} does not divide the data-parallel size {data_parallel} (world / (TP x PP)); "
        "expert parallelism splits the data-parallel ranks",
    )
