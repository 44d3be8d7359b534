"""Process runtime: distributed init, megatron parallel state, seeds, device, CPU compatibility."""

from megatron_kto.runtime.distributed import Runtime, init_runtime, set_seed, teardown

__all__ = ["Runtime", "init_runtime", "set_seed", "teardown"]
