"""megatron_kto: KTO and DPO alignment on megatron-core."""

import warnings

# megatron-core warns at import time when Transformer Engine / Apex are absent and falls back to
# its own modules, which is the expected set-up on CPU; keep start-up output readable.
warnings.filterwarnings(
    "ignore", message=r".*(Transformer Engine|Apex).*not installed.*", category=UserWarning
)

__version__ = "0.1.0"
