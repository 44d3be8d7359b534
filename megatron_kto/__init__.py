"""megatron_kto: KTO and DPO alignment on megatron-core."""

__version__ = "0.1.0"
