"""Hugging Face <-> megatron_kto checkpoint conversion (Llama/Llama-3, Mistral, Qwen2).

`hf_config` maps config.json to a `GPTArchitecture` and back, `keymap` is the declarative tensor
map with pure fuse/split functions, `safetensors_io` streams tensors in and out, and `convert`
drives a whole import or export (`tools/convert_checkpoint.py` is its command line).
"""

from megatron_kto.conversion.hf_config import ConversionError

__all__ = ["ConversionError"]
