"""Hugging Face <-> megatron_kto checkpoint conversion (Llama/Llama-3, Mistral, Qwen2, Qwen3,
Qwen3-MoE, Mixtral).

`addressing` is every tensor's address: the table entries (megatron and Hugging Face names, fusion
kind, TP axis, expert), the layer / expert name spellings and local <-> global numbering, each
rank's slices and the reassembly of shards — pure, no process group. `registry` keys the families
(`families/<type>.py`: one table plus its config mapping; `families/__init__.py` holds what they
share) by Hugging Face `model_type`; `hf_config` maps config.json to a `GPTArchitecture` and back;
`mappings` converts whole tensors both ways (`moe` adds routers and experts);
`safetensors_io` streams tensors in and out, and `convert` drives a whole import or export
(`tools/convert_checkpoint.py` is its command line). Imports run one way:
errors <- addressing <- moe <- families <- registry <- hf_config, mappings <- convert.
"""

from megatron_kto.conversion.errors import ConversionError

__all__ = ["ConversionError"]
