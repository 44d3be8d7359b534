"""The training-time Hugging Face writer: gathers a run's sharded tensors over its process groups
(`gather.py`) and writes `hf/` / `hf_merged/` at a save (`output.py`). The conversion it applies is
`conversion/`'s pure tables and functions; the collectives live here, not there."""
