"""The tensor map's stable import point (callers and the PEFT room import it from here).

The table itself lives in `mappings.py` (shared entries and the two directions), the per-family
tables in `families/`, and the family registry in `registry.py`.
"""

from megatron_kto.conversion.mappings import (
    COLUMN,
    EMBEDDING,
    FINAL_NORM,
    LINEAR_MAPPINGS,
    LOCAL_NORMS,
    OUTPUT,
    REPLICATED,
    ROW,
    TE_NORMS,
    Getter,
    Mapping,
    fuse_fc1,
    fuse_qkv,
    norm_names,
    pad_rows,
    split_fc1,
    split_qkv,
    to_hf,
    to_megatron,
)

__all__ = [
    "COLUMN",
    "EMBEDDING",
    "FINAL_NORM",
    "LINEAR_MAPPINGS",
    "LOCAL_NORMS",
    "OUTPUT",
    "REPLICATED",
    "ROW",
    "TE_NORMS",
    "Getter",
    "Mapping",
    "fuse_fc1",
    "fuse_qkv",
    "norm_names",
    "pad_rows",
    "split_fc1",
    "split_qkv",
    "to_hf",
    "to_megatron",
]
