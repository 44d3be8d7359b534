"""Parameter-efficient fine-tuning (LoRA): adapters, their wiring, checkpoints and HF PEFT files.

- `targets`: NeMo / Hugging Face target names -> projections (pure, no torch).
- `settings`: `model.peft.*` checks and the reference policy LoRA implies (no torch).
- `lora`: the adapter beside a megatron-core / Transformer Engine parallel linear.
- `wiring`: apply to built chunks, freeze the base, adapters off, parameter counts.
"""
