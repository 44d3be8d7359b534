"""GPU-only speed settings: what a CUDA (+ Transformer Engine) machine gets, checked on CPU.

The decisions live in `runtime.gpu_settings` as functions of an `Accelerator` record, so these
tests describe the GPU machine by hand instead of patching megatron-core. Where megatron-core
itself validates a switch on CPU (bias+activation fusion), the test asks megatron-core whether
our choice is one it accepts.
"""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.runtime.gpu_settings import (
    Accelerator,
    ddp_overlap_settings,
    fusion_settings,
    launch_environment,
    transformer_engine_warning,
)

LLAMA = GPTArchitecture(activation="swiglu", position_embedding_type="rope", add_bias_linear=False)
CPU = Accelerator(cuda=False)
H100_NGC = Accelerator(
    cuda=True, transformer_engine="2.9.0+70f53666", grad_accum_fusion_kernel=True
)


def test_cpu_gets_no_fused_kernels() -> None:
    assert not any(fusion_settings(CPU, LLAMA).values())
    # Even with TE and Apex installed, nothing fused runs without CUDA.
    assert not any(
        fusion_settings(
            Accelerator(cuda=False, transformer_engine="2.9.0", grad_accum_fusion_kernel=True),
            LLAMA,
        ).values()
    )


def test_cuda_with_te_and_apex_kernel_turns_every_valid_fusion_on() -> None:
    s = fusion_settings(H100_NGC, LLAMA)
    assert s["gradient_accumulation_fusion"] and s["apply_rope_fusion"]
    assert s["bias_activation_fusion"] and s["bias_dropout_fusion"]
    assert not s["masked_softmax_fusion"] and not s["persist_layer_norm"]


def test_fusions_follow_what_is_installed() -> None:
    no_apex = Accelerator(cuda=True, transformer_engine="2.10.0", grad_accum_fusion_kernel=False)
    assert not fusion_settings(no_apex, LLAMA)["gradient_accumulation_fusion"]
    assert fusion_settings(no_apex, LLAMA)["apply_rope_fusion"]
    no_te = Accelerator(cuda=True, transformer_engine=None, grad_accum_fusion_kernel=True)
    assert not fusion_settings(no_te, LLAMA)["apply_rope_fusion"]
    learned = GPTArchitecture(position_embedding_type="learned_absolute")
    assert not fusion_settings(H100_NGC, learned)["apply_rope_fusion"]


@pytest.mark.parametrize(
    ("activation", "bias"),
    [("swiglu", False), ("swiglu", True), ("gelu", True), ("gelu", False), ("relu", True)],
)
def test_bias_activation_fusion_only_where_megatron_accepts_it(activation, bias) -> None:
    arch = GPTArchitecture(activation=activation, add_bias_linear=bias)
    ours = fusion_settings(Accelerator(cuda=True), arch)["bias_activation_fusion"]
    func = {"swiglu": F.silu, "gelu": F.gelu, "relu": F.relu}[activation]
    try:
        TransformerConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            gated_linear_unit=activation == "swiglu",
            activation_func=func,
            add_bias_linear=bias,
            bias_activation_fusion=True,
        )
        accepted = True
    except ValueError:
        accepted = False
    assert ours == accepted


def test_builder_takes_its_fusions_from_the_decision(monkeypatch) -> None:
    from megatron_kto.models import builder

    monkeypatch.setattr(
        builder.Accelerator, "detect", classmethod(lambda cls, read_device=False: Accelerator(True))
    )
    config = builder.make_transformer_config(LLAMA, builder.ParallelLayout())
    assert config.bias_activation_fusion and config.bias_dropout_fusion
    assert not config.apply_rope_fusion and not config.gradient_accumulation_fusion


def test_distributed_optimizer_overlaps_both_collectives_by_default() -> None:
    assert ddp_overlap_settings(True) == {"overlap_grad_reduce": True, "overlap_param_gather": True}
    assert ddp_overlap_settings(False) == {
        "overlap_grad_reduce": False,
        "overlap_param_gather": False,
    }
    assert ddp_overlap_settings(True, overlap_param_gather=False)["overlap_param_gather"] is False
    assert ddp_overlap_settings(False, overlap_grad_reduce=True)["overlap_grad_reduce"] is True
    with pytest.raises(ValueError, match="distributed optimizer"):
        ddp_overlap_settings(False, overlap_param_gather=True)
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, **ddp_overlap_settings(True)
    )
    assert config.overlap_grad_reduce and config.overlap_param_gather


def test_device_max_connections_for_tensor_parallel_cuda_runs() -> None:
    assert launch_environment(True, 2, {}) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert launch_environment(True, 1, {}) == {}
    assert launch_environment(False, 4, {}) == {}
    assert launch_environment(True, 8, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) == {}


@pytest.mark.parametrize(
    ("version", "warns"),
    [
        (None, False),
        ("2.9.0", False),
        ("2.9.0+70f53666", False),
        ("2.10.0.dev0+abc", False),
        ("2.11.1", False),
        ("2.8.0", True),
        ("1.14.0", True),
        ("2.12.0", True),
        ("not-a-version", True),
    ],
)
def test_transformer_engine_range(version, warns) -> None:
    assert (transformer_engine_warning(version) is not None) == warns


def test_srun_tasks_become_ranks_without_torchrun() -> None:
    from megatron_kto.runtime.launcher_env import adopt_launcher_env

    env = {
        "SLURM_PROCID": "11",
        "SLURM_NTASKS": "16",
        "SLURM_STEP_NUM_TASKS": "16",
        "SLURM_LOCALID": "3",
        "SLURM_JOB_ID": "123456",
        "MASTER_ADDR": "node001",
    }
    adopt_launcher_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("11", "16", "3")
    assert env["MASTER_PORT"] == str(20000 + 123456 % 20000)
    # torchrun's variables win; a lone process stays a world of one.
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}
    adopt_launcher_env(torchrun)
    assert torchrun["RANK"] == "1" and "LOCAL_RANK" not in torchrun
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        adopt_launcher_env({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "0"})
    single = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0"}
    adopt_launcher_env(single)  # an interactive 1-task allocation needs no rendezvous address
    assert single["WORLD_SIZE"] == "1"
    # The batch script of an 8-task allocation (no srun step): SLURM_PROCID=0 and
    # SLURM_NTASKS=8 are set, but `python train.py` there is one process, not rank 0 of 8.
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0"}
    adopt_launcher_env(batch)
    assert "WORLD_SIZE" not in batch and "RANK" not in batch
