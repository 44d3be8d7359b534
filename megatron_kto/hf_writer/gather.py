"""Full (TP=1, EP=1) tensors of one pipeline stage, gathered from the ranks that shard them.

The conversion table is written for whole tensors; a training run holds them cut over tensor
parallelism and, for experts, spread over expert parallelism. `StageTensors.get` answers the
table's megatron names for the layers this rank's pipeline stage holds, one tensor at a time. How
each tensor was cut and how the shards go back together is the entry's (`conversion.addressing`:
`tp_axis`, `kind`, `expert`, `merge_shards`, `expert_owner`); the collectives are here:

- a TP-sharded tensor is all-gathered over the tensor-parallel group (the expert
  tensor-parallel group for experts) and merged (`merge_shards`);
- an expert is broadcast over the expert-parallel group from the rank that owns it;
- a replicated tensor is this rank's own.

Every rank of the stage must ask for the same names in the same order (the gathers are
collectives); only the stage's writer keeps what it gets. Memory: one gathered tensor at a time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.addressing import (
    EMBEDDING,
    FINAL_NORM,
    OUTPUT,
    ChunkLayout,
    Mapping,
    ParamName,
    expert_owner,
    norm_names,
    parse_name,
)
from megatron_kto.conversion.deltanet import tp_sections
from megatron_kto.conversion.mappings import layer_table
from megatron_kto.models.builder import named_weights, unwrap
from megatron_kto.models.tp_gather import gather_tp

#: The entries of the tensors outside the transformer layers, by megatron name.
_OUTSIDE_LAYERS = {e.megatron: e for e in (EMBEDDING, FINAL_NORM, OUTPUT)}


class StageTensors:
    """The megatron tensors of this rank's pipeline stage, by their TP=1 / EP=1 global names.

    Args:
        chunks: this rank's model chunks (DDP-wrapped or not).
        arch: the model's architecture.
        family: the export's model type (its table gives each tensor's TP axis and kind).
    """

    def __init__(self, chunks: list[torch.nn.Module], arch: GPTArchitecture, family: str):
        models = [unwrap(c) for c in chunks]
        self._params: dict[str, torch.Tensor] = {}
        layers: list[int] = []
        self._experts: tuple[int, ...] = ()
        """Global indices of this rank's local experts."""
        for model in models:
            layout = ChunkLayout.of(model)
            layers += layout.layers
            self._experts = self._experts or layout.experts
            for name, param in named_weights(model).items():
                self._params[str(layout.to_global(name))] = param
        self.norms = norm_names(list(self._params))
        self.table: dict[str, Mapping] = layer_table(arch, self.norms, family)
        self.arch = arch
        self.layers = sorted(layers)
        """Global indices of the transformer layers this stage holds."""
        self.first = any(m.pre_process for m in models)
        """Whether this stage holds the embedding."""
        self.last = any(m.post_process for m in models)
        """Whether this stage holds the final norm and the output layer."""
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._etp_group = ps.get_expert_tensor_parallel_group()
        self._ep = ps.get_expert_model_parallel_world_size()
        self._ep_rank = ps.get_expert_model_parallel_rank()
        if self._ep > 1:
            self._ep_group = ps.get_expert_model_parallel_group()
            self._ep_ranks = dist.get_process_group_ranks(self._ep_group)
        self._num_experts = arch.num_moe_experts or 0

    def _local(self, name: str) -> torch.Tensor:
        try:
            return self._params[name].detach()
        except KeyError:
            raise KeyError(f"{name}: not held by this pipeline stage") from None

    @torch.no_grad()
    def get(self, name: str) -> torch.Tensor:
        """The full tensor of megatron name `name` (collective over the stage's TP/EP groups)."""
        address = parse_name(name)
        if address.layer is None:  # embedding and output rows are vocabulary-parallel
            entry = _OUTSIDE_LAYERS[name]
            return gather_tp(self._local(name), entry.tp_axis, entry.kind, self._tp_group)
        entry = self.table[address.in_layer]
        if entry.expert:
            return self._expert(address, entry)
        sections = tp_sections(entry.kind, self.arch)  # DeltaNet tensors: per-rank part shares
        return gather_tp(self._local(name), entry.tp_axis, entry.kind, self._tp_group, sections)

    def _expert(self, address: ParamName, entry: Mapping) -> torch.Tensor:
        owner, local = expert_owner(address.expert, self._num_experts, self._ep)
        # Every EP rank takes its own expert in the same local slot (a collective over ETP).
        mine = str(address.renumbered(expert=self._experts[local]))
        full = gather_tp(self._local(mine), entry.tp_axis, entry.kind, self._etp_group)
        if self._ep == 1:
            return full
        # Every EP rank holds a local expert of the same shape: a receive buffer needs no
        # shape exchange. The owner sends its own tensor (a broadcast does not modify it).
        buffer = full if owner == self._ep_rank else torch.empty_like(full)
        dist.broadcast(buffer, src=self._ep_ranks[owner], group=self._ep_group)
        return buffer
