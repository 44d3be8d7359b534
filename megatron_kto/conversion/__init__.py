"""Hugging Face <-> megatron_kto checkpoint conversion (Llama/Llama-3, Mistral, Qwen2, Qwen3,
Qwen3-MoE, Mixtral).

`registry` keys the families (`families/<type>.py`) by Hugging Face `model_type`; `hf_config`
maps the shared config.json fields to a `GPTArchitecture` and back; `mappings` is the
declarative tensor table with pure fuse/split functions (`moe` adds routers and experts; `keymap`
re-exports it); `safetensors_io` streams tensors in and out, and `convert` drives a whole import
or export (`tools/convert_checkpoint.py` is its command line).
"""

from megatron_kto.conversion.hf_config import ConversionError

__all__ = ["ConversionError"]
