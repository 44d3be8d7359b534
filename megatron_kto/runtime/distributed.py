"""Process-level runtime: torch.distributed, megatron parallel state, seeds and the device.

`init_runtime()` is the one call every entry point makes; library code receives the returned
`Runtime` (or reads megatron's `parallel_state`) instead of asking CUDA for a device.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_kto.runtime.cpu_compat import apply as apply_cpu_compat
from megatron_kto.runtime.gpu_settings import (
    Accelerator,
    apply_launch_environment,
    transformer_engine_warning,
)
from megatron_kto.runtime.launcher_env import adopt_launcher_env
from megatron_kto.runtime.peers import register_process


@dataclass(frozen=True)
class Runtime:
    """What a rank needs to know about where it runs."""

    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    virtual_pipeline_parallel_size: int | None
    data_parallel_size: int
    data_parallel_rank: int
    pipeline_parallel_rank: int
    tensor_parallel_rank: int
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    """ETP degree of the MoE experts; None = tensor_parallel_size."""

    @property
    def is_rank0(self) -> bool:
        """True on global rank 0 (the rank that writes logs)."""
        return self.rank == 0

    @property
    def is_cpu(self) -> bool:
        """True when running on the CPU (gloo)."""
        return self.device.type == "cpu"


#: Lowest port `rendezvous_port` draws (below it sit well-known and registered services).
_LOWEST_PORT = 10000


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral (auto-assigned local) port range; Linux's default if unreadable."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def rendezvous_port(attempts: int = 64) -> int:
    """A free TCP port for a local rendezvous store, drawn outside the kernel's ephemeral range.

    A port the kernel handed out by ``bind(0)`` lies inside the ephemeral range, from which the
    other ranks' connecting sockets also take their local ports. While rank 0's store is not yet
    listening, a rank retrying its connection can be given the store's own port as its local
    port; on loopback that socket connects to itself and holds the port, and rank 0's store then
    fails with EADDRINUSE. A port outside the range is never chosen as a local port. The draw uses
    the OS's randomness (not `random`, which the tests and `set_seed` seed), so two concurrent
    runs do not draw the same sequence; if no port outside the range is free, ``bind(0)``.
    """
    low, high = _ephemeral_range()
    ports = [p for a, b in ((_LOWEST_PORT, low - 1), (high + 1, 65535)) for p in range(a, b + 1)]
    draw = random.SystemRandom()
    for _ in range(attempts if ports else 0):
        port = draw.choice(ports)
        if _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Launcher variables `_ensure_env` invented for a world of one; `teardown` removes them again,
#: so that programs started later by this process (tests, tools) do not inherit a rendezvous
#: port that this process's store may still hold.
_INVENTED_ENV: list[str] = []


def _ensure_env() -> None:
    adopt_launcher_env()
    # A plain `python script.py` (no torchrun) runs as a world of one.
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    if "MASTER_PORT" not in os.environ:
        defaults["MASTER_PORT"] = str(rendezvous_port())
    for key, value in defaults.items():
        if key not in os.environ:
            os.environ[key] = value
            _INVENTED_ENV.append(key)


def _rendezvous(timeout: datetime.timedelta) -> dict[str, object]:
    """`init_process_group`'s rendezvous arguments: torch's own (`env://`) outside torchrun;
    under torchrun, its store under a prefix of this attempt (`TORCHELASTIC_RESTART_COUNT`).

    Workaround (torch 2.x, gloo): after `torchrun --max-restarts N` restarts the workers of a
    failed attempt, `env://` joins the same store under the same `default_pg` prefix, where the
    killed attempt's keys are still set; gloo's connectFullMesh reads a dead worker's address
    from them and the restarted ranks fail with "Gloo connectFullMesh failed ... Connection
    refused" (or wait for it). A prefix per attempt gives each attempt keys of its own.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0 does.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_store,
        timeout=timeout,
        multi_tenant=True,
    )
    prefixed = dist.PrefixStore(f"megatron_kto/attempt_{attempt}", store)
    return {"store": prefixed, "rank": rank, "world_size": world}


def set_seed(seed: int) -> None:
    """Seed Python, NumPy, torch and megatron's model-parallel RNG tracker.

    Pipeline stages get different base seeds (as in Megatron-LM) so that dropout differs per stage;
    tensor-parallel ranks share the base seed (identical CPU-initialised master weights) and get
    distinct tensor-parallel streams from `model_parallel_cuda_manual_seed`.
    """
    from megatron.core import parallel_state, tensor_parallel

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_runtime(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    virtual_pipeline_parallel_size: int | None = None,
    seed: int = 1234,
    device: str = "auto",
    timeout_minutes: float = 30.0,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> Runtime:
    """Initialise torch.distributed and megatron-core's parallel state for this process.

    Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); without it the
    process runs alone. Uses NCCL on GPU and gloo on CPU (where the CPU compatibility layer is
    applied first).

    Args:
        tensor_parallel_size: TP degree.
        pipeline_parallel_size: PP degree.
        virtual_pipeline_parallel_size: model chunks per pipeline rank (interleaved 1F1B), or None.
        seed: base random seed.
        device: "auto" (CUDA if available), "cuda" or "cpu".
        timeout_minutes: collective timeout of the default group and of megatron's groups
            (`trainer.distributed_timeout_minutes`).
        expert_parallel_size: EP degree of MoE layers (ranks within the data-parallel group
            that split each layer's experts); 1 for dense models.
        context_parallel_size: CP degree (ranks each row is split over along the sequence).
        expert_tensor_parallel_size: ETP degree (ranks each expert's linears are split over);
            None = `tensor_parallel_size`.

    Returns:
        The `Runtime` of this rank.
    """
    from megatron.core import parallel_state

    _ensure_env()
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        # Before set_device creates this rank's CUDA context, which reads these variables.
        apply_launch_environment(True, tensor_parallel_size)
        # `srun --gpus-per-task=1` shows each task one GPU; otherwise one per local rank.
        device_index = local_rank % torch.cuda.device_count()
        if local_rank == 0:
            warning = transformer_engine_warning(Accelerator.detect().transformer_engine)
            if warning:
                logging.getLogger(__name__).warning("%s", warning)
        torch.cuda.set_device(device_index)
        dev = torch.device("cuda", device_index)
        backend = "nccl"
    else:
        apply_cpu_compat(force=torch.cuda.is_available())
        dev = torch.device("cpu")
        backend = "gloo"

    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            **_rendezvous(timeout),
            **({"device_id": dev} if use_cuda else {}),
        )
    register_process()
    world_size = dist.get_world_size()
    model_parallel = tensor_parallel_size * pipeline_parallel_size * context_parallel_size
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size "
            f"({tensor_parallel_size}) x pipeline_model_parallel_size ({pipeline_parallel_size})"
            f" x context_parallel_size ({context_parallel_size})"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_parallel_size,
        expert_model_parallel_size=expert_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
    )
    set_seed(seed)
    return Runtime(
        device=dev,
        rank=dist.get_rank(),
        world_size=world_size,
        local_rank=local_rank,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        virtual_pipeline_parallel_size=virtual_pipeline_parallel_size,
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        pipeline_parallel_rank=parallel_state.get_pipeline_model_parallel_rank(),
        tensor_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
        expert_parallel_size=expert_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )


def teardown(barrier: bool = True) -> None:
    """Destroy megatron's groups and the default process group (safe to call twice).

    Args:
        barrier: wait for every rank first; False after a peer is gone (it would never come).
    """
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    while _INVENTED_ENV:
        os.environ.pop(_INVENTED_ENV.pop(), None)
