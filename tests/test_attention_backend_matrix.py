"""The attention-backend decision for every stated machine × precision × packing × request.

Every expected cell below is written out by hand from the facts in Transformer Engine's sources
(the table in `megatron_kto/runtime/attention_backend.py`): TE 2.9/2.10 have no attention for
packed (THD) input in fp32 — flash and fused need bf16/fp16 and the unfused backend refuses THD
before 2.11; no TE backend runs fp32 under context parallelism; TE needs CUDA. `ERR` marks an
explicit choice (or a configuration) that must be refused with one line naming the key.
"""

from __future__ import annotations

import pytest

from megatron_kto.runtime.attention_backend import AttentionFeatures, choose_attention_backend
from megatron_kto.runtime.gpu_settings import Accelerator

MACHINES = {
    "cpu": Accelerator(cuda=False),
    "cpu_with_te": Accelerator(cuda=False, transformer_engine="2.9.0"),  # TE needs CUDA
    "cuda_no_te": Accelerator(cuda=True),
    "te_2.9": Accelerator(cuda=True, transformer_engine="2.9.0+70f53666"),  # NGC 25.11
    "te_2.10": Accelerator(cuda=True, transformer_engine="2.10.0"),
    "te_2.11": Accelerator(cuda=True, transformer_engine="2.11.0"),
}
ERR = "ERR"

# machine, precision, packed -> decision for requests (auto, te, sdpa, local).
# Head dim 64, no context parallelism.
MATRIX = {
    ("cpu", "32", True): ("sdpa", ERR, "sdpa", ERR),
    ("cpu", "32", False): ("sdpa", ERR, "sdpa", "local"),
    ("cpu", "bf16", True): ("sdpa", ERR, "sdpa", ERR),
    ("cpu", "bf16", False): ("sdpa", ERR, "sdpa", "local"),
    ("cpu", "16", True): ("sdpa", ERR, "sdpa", ERR),
    ("cpu", "16", False): ("sdpa", ERR, "sdpa", "local"),
    ("cpu_with_te", "bf16", True): ("sdpa", ERR, "sdpa", ERR),
    ("cpu_with_te", "bf16", False): ("sdpa", ERR, "sdpa", "local"),
    ("cuda_no_te", "32", True): ("sdpa", ERR, "sdpa", ERR),
    ("cuda_no_te", "32", False): ("sdpa", ERR, "sdpa", "local"),
    ("cuda_no_te", "bf16", True): ("sdpa", ERR, "sdpa", ERR),
    ("cuda_no_te", "bf16", False): ("sdpa", ERR, "sdpa", "local"),
    ("cuda_no_te", "16", True): ("sdpa", ERR, "sdpa", ERR),
    ("cuda_no_te", "16", False): ("sdpa", ERR, "sdpa", "local"),
    # TE 2.9: fp32 + packing has no TE backend at all; fp32 unpacked runs TE's unfused attention
    # (allowed when asked for, not chosen by auto: SDPA does fp32 without materialising scores).
    ("te_2.9", "32", True): ("sdpa", ERR, "sdpa", ERR),
    ("te_2.9", "32", False): ("sdpa", "te", "sdpa", "local"),
    ("te_2.9", "bf16", True): ("te", "te", "sdpa", ERR),
    ("te_2.9", "bf16", False): ("te", "te", "sdpa", "local"),
    ("te_2.9", "16", True): ("te", "te", "sdpa", ERR),
    ("te_2.9", "16", False): ("te", "te", "sdpa", "local"),
    ("te_2.10", "32", True): ("sdpa", ERR, "sdpa", ERR),
    ("te_2.10", "32", False): ("sdpa", "te", "sdpa", "local"),
    ("te_2.10", "bf16", True): ("te", "te", "sdpa", ERR),
    # TE 2.11: the unfused backend takes THD, so an explicit te runs fp32 + packing.
    ("te_2.11", "32", True): ("sdpa", "te", "sdpa", ERR),
    ("te_2.11", "32", False): ("sdpa", "te", "sdpa", "local"),
    ("te_2.11", "bf16", True): ("te", "te", "sdpa", ERR),
    ("te_2.11", "bf16", False): ("te", "te", "sdpa", "local"),
    ("te_2.11", "16", True): ("te", "te", "sdpa", ERR),
    ("te_2.11", "16", False): ("te", "te", "sdpa", "local"),
}
REQUESTS = ("auto", "te", "sdpa", "local")

# (machine, precision, packed, head dim, context parallel size, sequence parallel, request)
# -> decision: head dims outside the fused kernels' range, context parallelism, SP.
EDGE_CELLS = {
    # Head dim 96 / 128: multiples of 8 up to 128 have fused kernels on every GPU.
    ("te_2.9", "bf16", True, 128, 1, False, "auto"): "te",
    ("te_2.9", "bf16", True, 96, 1, False, "auto"): "te",
    # 192: kernels only on Hopper (cuDNN >= 9.5) or with flash-attn: auto plays safe, te may run.
    ("te_2.9", "bf16", True, 192, 1, False, "auto"): "sdpa",
    ("te_2.9", "bf16", True, 192, 1, False, "te"): "te",
    # 100 (not a multiple of 8) / 320 (> 256): no flash/fused kernel; packed on 2.9 nothing.
    ("te_2.9", "bf16", True, 100, 1, False, "auto"): "sdpa",
    ("te_2.9", "bf16", True, 100, 1, False, "te"): ERR,
    ("te_2.9", "bf16", True, 320, 1, False, "te"): ERR,
    ("te_2.9", "bf16", False, 100, 1, False, "te"): "te",  # unfused, unpacked
    ("te_2.11", "bf16", True, 100, 1, False, "te"): "te",  # unfused takes THD from 2.11
    ("te_2.11", "bf16", True, 100, 1, False, "auto"): "sdpa",
    # Context parallelism: TE's CP needs flash/fused (half precision, kernel head dims); our
    # SDPA has its own CP, so auto follows the CP = 1 rule; megatron's `local` has none.
    ("te_2.9", "bf16", True, 64, 2, False, "auto"): "te",
    ("te_2.9", "bf16", False, 64, 2, False, "te"): "te",
    ("te_2.9", "bf16", True, 192, 2, False, "auto"): "sdpa",  # no fused kernel for sure
    ("te_2.9", "bf16", True, 64, 2, False, "sdpa"): "sdpa",
    ("te_2.9", "bf16", False, 64, 2, False, "local"): ERR,
    ("cpu", "32", False, 64, 2, False, "local"): ERR,
    ("te_2.9", "32", False, 64, 2, False, "auto"): "sdpa",
    ("te_2.11", "32", False, 64, 2, False, "te"): ERR,
    ("te_2.11", "bf16", True, 100, 2, False, "te"): ERR,
    ("cuda_no_te", "bf16", True, 64, 2, False, "auto"): "sdpa",
    ("cpu", "32", False, 64, 2, False, "auto"): "sdpa",
    ("cpu", "32", True, 64, 4, True, "sdpa"): "sdpa",
    # Sequence parallelism changes nothing.
    ("te_2.9", "32", True, 64, 1, True, "auto"): "sdpa",
    ("te_2.9", "bf16", True, 64, 1, True, "auto"): "te",
    ("cuda_no_te", "bf16", True, 64, 1, True, "sdpa"): "sdpa",
    # A TE version that does not parse is taken as the older, stricter behaviour.
    ("te_unknown", "32", True, 64, 1, False, "te"): ERR,
    ("te_unknown", "bf16", True, 64, 1, False, "auto"): "te",
}
MACHINES["te_unknown"] = Accelerator(cuda=True, transformer_engine="unknown")
# The GPU generation, as the model builder reads it once the device is set: cuDNN's fused
# attention takes packed (THD) input only on sm90+, flash-attn on sm80+ too.
MACHINES["te_2.9_a100"] = Accelerator(
    cuda=True, transformer_engine="2.9.0", compute_capability=(8, 0)
)
MACHINES["te_2.9_a100_flash"] = Accelerator(
    cuda=True, transformer_engine="2.9.0", compute_capability=(8, 0), flash_attn=True
)
MACHINES["te_2.9_h100"] = Accelerator(
    cuda=True, transformer_engine="2.9.0", compute_capability=(9, 0)
)
MACHINES["te_2.11_a100"] = Accelerator(
    cuda=True, transformer_engine="2.11.0", compute_capability=(8, 0)
)
GPU_CELLS = {
    # machine, precision, packed -> (auto, te, sdpa, local)
    ("te_2.9_a100", "bf16", True): ("sdpa", ERR, "sdpa", ERR),
    ("te_2.9_a100", "bf16", False): ("te", "te", "sdpa", "local"),
    ("te_2.9_a100_flash", "bf16", True): ("te", "te", "sdpa", ERR),
    ("te_2.9_h100", "bf16", True): ("te", "te", "sdpa", ERR),
    ("te_2.9_h100", "32", True): ("sdpa", ERR, "sdpa", ERR),
    # TE 2.11's unfused attention takes THD: an explicit te runs (slowly), auto keeps SDPA.
    ("te_2.11_a100", "bf16", True): ("sdpa", "te", "sdpa", ERR),
}


def _decide(machine, precision, packed, request, head_dim=64, cp=1, sp=False, features=None) -> str:
    try:
        choice = choose_attention_backend(
            request,
            precision=precision,
            packed=packed,
            accelerator=MACHINES[machine],
            features=features or AttentionFeatures(head_dim=head_dim),
            context_parallel_size=cp,
            sequence_parallel=sp,
        )
    except ValueError as e:
        message = str(e)
        assert "\n" not in message, message
        key = (
            "model.data.pack_sequences"
            if request == "local" and packed
            else "model.attention_backend"
        )
        assert message.startswith(f"{key}: "), message
        return ERR
    assert choice.reason, choice
    return choice.backend


@pytest.mark.parametrize("cell", sorted(MATRIX), ids=lambda c: "-".join(map(str, c)))
def test_matrix_cell(cell):
    got = tuple(_decide(*cell, request) for request in REQUESTS)
    assert got == MATRIX[cell], dict(zip(REQUESTS, got))


@pytest.mark.parametrize("cell", sorted(EDGE_CELLS), ids=lambda c: "-".join(map(str, c)))
def test_edge_cell(cell):
    machine, precision, packed, head_dim, cp, sp, request = cell
    assert _decide(machine, precision, packed, request, head_dim, cp, sp) == EDGE_CELLS[cell]


def test_the_matrix_covers_every_request_on_the_stated_machines():
    """No cell forgotten: every machine the issue names × precision × packing is in MATRIX."""
    for machine in ("cpu", "cuda_no_te", "te_2.9", "te_2.11"):
        for precision in ("32", "bf16", "16"):
            for packed in (True, False):
                assert (machine, precision, packed) in MATRIX


def test_fp32_packing_on_te_2_9_says_what_to_set():
    """The issue's crash, refused up front: the message names TE's limits and three fixes."""
    with pytest.raises(ValueError) as err:
        choose_attention_backend(
            "te",
            precision="32",
            packed=True,
            accelerator=MACHINES["te_2.9"],
            features=AttentionFeatures(head_dim=64),
        )
    assert str(err.value) == (
        "model.attention_backend: 'te' cannot run fp32 + packed sequences (Transformer Engine "
        "2.9.0+70f53666: its flash and fused attention need bf16 or fp16, its unfused attention "
        "takes packed (THD) input only from 2.11.0); set model.attention_backend=sdpa (or auto), "
        "trainer.precision=bf16, or model.data.pack_sequences=false"
    )


def test_auto_says_why():
    cases = {
        "cpu": ("32", "sdpa (no CUDA device)"),
        "cuda_no_te": ("bf16", "sdpa (Transformer Engine is not installed)"),
        "te_2.11": (
            "bf16",
            "te (Transformer Engine 2.11.0: fused attention for bf16 + packed sequences)",
        ),
    }
    for machine, (precision, want) in cases.items():
        choice = choose_attention_backend(
            "auto",
            precision=precision,
            packed=True,
            accelerator=MACHINES[machine],
            features=AttentionFeatures(head_dim=64),
        )
        assert choice.describe() == want
        assert choice.note("auto") == f"model.attention_backend=auto: {want}"


def test_unknown_backend_names_the_choices():
    with pytest.raises(
        ValueError,
        match=r"^model\.attention_backend: must be one of \['auto', 'te', 'sdpa', 'local'\], got 'flash'$",
    ):
        choose_attention_backend(
            "flash",
            precision="32",
            packed=False,
            accelerator=MACHINES["cpu"],
            features=AttentionFeatures(head_dim=64),
        )


@pytest.mark.parametrize("cell", sorted(GPU_CELLS), ids=lambda c: "-".join(map(str, c)))
def test_gpu_generation_cell(cell):
    got = tuple(_decide(*cell, request) for request in REQUESTS)
    assert got == GPU_CELLS[cell], dict(zip(REQUESTS, got))


def test_a100_without_flash_attn_refuses_te_for_packed_bf16_in_one_line():
    with pytest.raises(ValueError) as err:
        choose_attention_backend(
            "te",
            precision="bf16",
            packed=True,
            accelerator=MACHINES["te_2.9_a100"],
            features=AttentionFeatures(head_dim=64),
        )
    assert str(err.value).startswith("model.attention_backend: 'te' cannot run bf16 + packed")
    assert "sm80" in str(err.value) and "flash-attn" in str(err.value)


# Multi-latent attention (DeepSeek-V3), by hand from `runtime/te_latent_attention.py`'s table:
# flash-attn 2 never takes a value head dim of its own; cuDNN both dims multiples of 8 <= 128
# everywhere, 192 / 128 on Hopper (cuDNN >= 9.5) or Blackwell (9.11); other unequal dims >= 128
# not on Hopper with cuDNN >= 9.11; the unfused path any dims (THD from 2.11, no CP); TE < 1.10
# never (megatron-core passes k/v head dims there first); CP from 2.5.
MACHINES.update(
    {
        "te_1.9": Accelerator(cuda=True, transformer_engine="1.9.0"),
        "te_2.4": Accelerator(cuda=True, transformer_engine="2.4.0"),
        "te_2.9_h100_cudnn9.14": Accelerator(
            cuda=True, transformer_engine="2.9.0", compute_capability=(9, 0), cudnn=91400
        ),
        "te_2.9_h100_cudnn9.4": Accelerator(
            cuda=True, transformer_engine="2.9.0", compute_capability=(9, 0), cudnn=90400
        ),
        "te_2.9_b200_cudnn9.11": Accelerator(
            cuda=True, transformer_engine="2.9.0", compute_capability=(10, 0), cudnn=91100
        ),
    }
)
# (machine, precision, packed, (qk, v) head dims, context parallel size) -> (auto, te, sdpa, local)
MLA_CELLS = {
    ("te_2.9", "bf16", False, (64, 32), 1): ("te", "te", "sdpa", ERR),
    ("te_2.9", "bf16", True, (64, 32), 1): ("te", "te", "sdpa", ERR),  # GPU unread: assumed sm90
    ("te_2.9", "32", False, (64, 32), 1): ("sdpa", "te", "sdpa", ERR),  # unfused only
    ("te_2.9", "32", True, (64, 32), 1): ("sdpa", ERR, "sdpa", ERR),
    # flash-attn installed changes nothing for MLA: packed on an A100 has no kernel.
    ("te_2.9_a100_flash", "bf16", True, (64, 32), 1): ("sdpa", ERR, "sdpa", ERR),
    ("te_2.11_a100", "bf16", True, (64, 32), 1): ("sdpa", "te", "sdpa", ERR),
    ("te_2.9_a100", "bf16", False, (64, 32), 1): ("te", "te", "sdpa", ERR),
    # DeepSeek-V3's 192 / 128: only with the GPU known (the builder) is the kernel sure.
    ("te_2.9", "bf16", True, (192, 128), 1): ("sdpa", "te", "sdpa", ERR),
    ("te_2.9_h100_cudnn9.14", "bf16", True, (192, 128), 1): ("te", "te", "sdpa", ERR),
    ("te_2.9_h100_cudnn9.4", "bf16", True, (192, 128), 1): ("sdpa", "te", "sdpa", ERR),
    ("te_2.9_h100_cudnn9.14", "bf16", False, (256, 128), 1): ("sdpa", "te", "sdpa", ERR),
    ("te_2.9_b200_cudnn9.11", "bf16", True, (192, 128), 1): ("te", "te", "sdpa", ERR),
    ("te_2.9_a100", "bf16", False, (192, 128), 1): ("sdpa", "te", "sdpa", ERR),
    ("te_2.9", "bf16", False, (100, 64), 1): ("sdpa", "te", "sdpa", ERR),
    ("te_2.9", "bf16", True, (100, 64), 1): ("sdpa", ERR, "sdpa", ERR),
    ("te_1.9", "bf16", False, (64, 32), 1): ("sdpa", ERR, "sdpa", ERR),
    ("te_2.4", "bf16", False, (64, 32), 2): ("sdpa", ERR, "sdpa", ERR),
    ("te_2.4", "bf16", False, (64, 32), 1): ("te", "te", "sdpa", ERR),
    ("te_2.9", "bf16", True, (64, 32), 2): ("te", "te", "sdpa", ERR),
    ("cpu", "32", True, (64, 32), 1): ("sdpa", ERR, "sdpa", ERR),
}


def _decide_mla(machine, precision, packed, dims, cp, request) -> str:
    features = AttentionFeatures(head_dim=dims[0], latent_attention=True, value_head_dim=dims[1])
    return _decide(machine, precision, packed, request, cp=cp, features=features)


@pytest.mark.parametrize("cell", sorted(MLA_CELLS), ids=lambda c: "-".join(map(str, c)))
def test_mla_cell(cell):
    got = tuple(_decide_mla(*cell, request) for request in REQUESTS)
    assert got == MLA_CELLS[cell], dict(zip(REQUESTS, got))


@pytest.mark.parametrize(
    "machine,cp,says",
    [
        ("te_1.9", 1, "reaches its attention only from 1.10.0"),
        ("te_2.4", 2, "its context parallelism takes multi-latent attention only from 2.5.0"),
    ],
)
def test_mla_te_refusal_names_the_key_and_the_version(machine, cp, says):
    def choose(request):
        return choose_attention_backend(
            request,
            precision="bf16",
            packed=False,
            accelerator=MACHINES[machine],
            features=AttentionFeatures(head_dim=64, latent_attention=True, value_head_dim=32),
            context_parallel_size=cp,
        )

    with pytest.raises(ValueError) as err:
        choose("te")
    message = str(err.value)
    assert message.startswith("model.attention_backend: 'te' cannot run this model (")
    assert says in message and message.endswith("set model.attention_backend=sdpa (or auto)")
    auto = choose("auto")
    assert auto.backend == "sdpa" and says in auto.note("auto")
