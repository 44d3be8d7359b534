"""Full (TP=1, EP=1) tensors of one pipeline stage, gathered from the ranks that shard them.

The conversion table (`mappings`) is written for whole tensors; a training run holds them cut
over tensor parallelism (along each entry's `tp_axis`) and, for experts, spread over expert
parallelism. `StageTensors.get` answers the table's megatron names for the layers this rank's
pipeline stage holds, one tensor at a time:

- a TP-sharded tensor is all-gathered over the tensor-parallel group (the expert
  tensor-parallel group for experts) and concatenated along its axis — except a gated fc1,
  whose shards each hold [this rank's gate rows; this rank's up rows], so the gate halves are
  concatenated, then the up halves;
- an expert is broadcast over the expert-parallel group from the rank that owns it (expert e
  lives on EP rank e // local_experts as local expert e % local_experts);
- a replicated tensor is this rank's own.

Every rank of the stage must ask for the same names in the same order (the gathers are
collectives); only the stage's writer keeps what it gets. Memory: one gathered tensor at a time.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.conversion.mappings import COLUMN, FINAL_NORM, Mapping, layer_table, norm_names
from megatron_kto.models.builder import unwrap
from megatron_kto.models.tp_gather import gather_tp

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
#: (prefix, expert index, suffix) of the local and Transformer Engine expert spellings.
_EXPERTS = (
    re.compile(r"(mlp\.experts\.local_experts\.)(\d+)(\..+)"),
    re.compile(r"(mlp\.experts\.linear_fc[12]\.weight)(\d+)()"),
)


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
        for model in models:
            offsets = [layer.layer_number - 1 for layer in model.decoder.layers]
            layers += offsets
            for name, param in model.named_parameters():
                match = _LAYER.fullmatch(name)
                if match is not None:
                    name = f"decoder.layers.{offsets[int(match[1])]}.{match[2]}"
                self._params[name] = param
        self.norms = norm_names(list(self._params))
        self.table: dict[str, Mapping] = layer_table(arch, self.norms, family)
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
        self._local_experts = (arch.num_moe_experts or 0) // self._ep

    def _local(self, name: str) -> torch.Tensor:
        try:
            return self._params[name].detach()
        except KeyError:
            raise KeyError(f"{name}: not held by this pipeline stage") from None

    @torch.no_grad()
    def get(self, name: str) -> torch.Tensor:
        """The full tensor of megatron name `name` (collective over the stage's TP/EP groups)."""
        match = _LAYER.fullmatch(name)
        if match is None:  # embedding and output rows are vocabulary-parallel; the norm is not
            axis = None if name == FINAL_NORM[0] else COLUMN
            return gather_tp(self._local(name), axis, "direct", self._tp_group)
        layer, rel = match[1], match[2]
        entry = self.table[rel]
        for pattern in _EXPERTS:
            expert = pattern.fullmatch(rel)
            if expert is not None:
                return self._expert(layer, expert, entry)
        return gather_tp(self._local(name), entry.tp_axis, entry.kind, self._tp_group)

    def _expert(self, layer: str, match: re.Match[str], entry: Mapping) -> torch.Tensor:
        owner, local = divmod(int(match[2]), self._local_experts)
        name = f"decoder.layers.{layer}.{match[1]}{local}{match[3]}"
        full = gather_tp(self._local(name), entry.tp_axis, entry.kind, self._etp_group)
        if self._ep == 1:
            return full
        # Every EP rank holds a local expert of the same shape: a receive buffer needs no
        # shape exchange. The owner sends its own tensor (a broadcast does not modify it).
        buffer = full if owner == self._ep_rank else torch.empty_like(full)
        dist.broadcast(buffer, src=self._ep_ranks[owner], group=self._ep_group)
        return buffer
