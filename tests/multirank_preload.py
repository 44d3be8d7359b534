"""Imported once, in the forkserver that `multirank` starts its ranks from (never by a test).

Each spawned rank used to pay the import of torch + megatron-core + our package (~5 s on a quiet
CI core, 10-15 s on a loaded one) before running its function. The ranks now fork from one
process that has already done these imports, so a run of N ranks pays them once per session.

Order matters: the NCCL-order recorder (`nccl_order.install`) patches torch.distributed before
megatron-core is imported (megatron-core binds some of those functions at import); every forked
rank inherits the patched functions and points the recorder at its run's trace directory
(`nccl_order.bind_rank`). The recorder holds no events here: this process never communicates.

A module that fails to import is skipped (the rank then imports what it needs itself), so this
list may lag behind refactors of the package without breaking a test.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import tempfile

# As in every rank (`multirank._entry`): one intra-op thread, set before torch is imported.
os.environ["OMP_NUM_THREADS"] = "1"

import nccl_order

# A placeholder directory: each rank re-targets the recorder before it records anything.
nccl_order.install(tempfile.gettempdir(), rank=0)

_HEAVY = (
    "torch",
    "torch.distributed",
    "torch.multiprocessing",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.pipeline_parallel",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
    "megatron.core.transformer.moe.moe_layer",
    "omegaconf",
    "hydra",
    "safetensors.torch",
    "megatron_kto.run",
    "megatron_kto.runtime",
    "megatron_kto.models.builder",
    "megatron_kto.checkpointing.model_io",
    "megatron_kto.checkpointing.manager",
    "megatron_kto.hf_writer.convert",
    "megatron_kto.peft",
    "megatron_kto.entry",
    "megatron_kto.config.schema",
    "sentencepiece",
    "transformers",
    "transformers.models.llama.modeling_llama",  # HF references in conversion / LoRA ranks
    "multirank",
    "e2e_cli",
)
for _name in _HEAVY:
    with contextlib.suppress(Exception):
        importlib.import_module(_name)
