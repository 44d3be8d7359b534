"""Parameter-efficient fine-tuning (LoRA): adapters, their wiring, checkpoints and HF PEFT files.

- `targets`: NeMo / Hugging Face target names -> projections (from the conversion key map).
- `settings`: `model.peft.*` checks and the reference policy LoRA implies.
- `lora`: the adapter beside a megatron-core / Transformer Engine parallel linear.
- `wiring`: apply to built chunks, freeze the base, adapters off or the frozen starting adapter
  (the reference), parameter counts.
- `reference`: `reference_policy=adapters_off` (base, or base + the starting adapter).
- `checkpoint`: adapter-only training checkpoints and the base's fingerprint.
- `hf_peft`: PEFT adapter directories in and out; merging into the base weights.
- `export`: what `tools/convert_checkpoint.py export` does with a LoRA run.
"""
