"""Hugging Face files in and out of runs — the impure side of conversion: building models,
reading and writing checkpoints, collectives.

- `gather.py`: a pipeline stage's whole tensors, gathered over its TP / ETP / EP groups;
- `output.py`: a run's `hf/` / `hf_merged/` at a save (`exp_manager.save_hf`);
- `convert.py`: `tools/convert_checkpoint.py`'s import and export drivers;
- `lora_export.py`: the export of a LoRA run (adapter directory, or merged weights).

What each tensor is called, how it is fused and sharded is `conversion/`'s pure tables and
functions (`conversion/addressing.py`); nothing here restates it.
"""
