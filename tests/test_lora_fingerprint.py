"""The LoRA base fingerprint (`peft.checkpoint.base_fingerprint`): the same sums as a float64
copy of every frozen tensor would give, without such a copy.

Its layout independence (TP/PP/EP) is shown end to end by `test_e2e_lora.py` (resume under
TP=2, refusal of another base) and `test_e2e_lora_moe.py` (EP=2 resume); here, on one process,
what it computes and what it allocates.
"""

from __future__ import annotations

import torch

from megatron_kto.peft.checkpoint import FINGERPRINT_SLICE, base_fingerprint
from megatron_kto.planning.measure import AllocationTrace

MIB = 2**20


class _Base(torch.nn.Module):
    """Frozen tensors of the kinds a base holds (fp32, bf16, a non-contiguous one) and one
    trainable tensor the fingerprint leaves out."""

    def __init__(self, big: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.dense = torch.nn.Parameter(torch.randn(big, generator=g) * 0.02 + 0.01)
        self.bf16 = torch.nn.Parameter(torch.randn(257, 129, generator=g).bfloat16())
        # A transposed view: not contiguous, read a block of rows at a time.
        self.transposed = torch.nn.Parameter(torch.randn(512, big // 512 // 4, generator=g).t())
        self.adapter = torch.nn.Parameter(torch.randn(1000, generator=g))
        for p in (self.dense, self.bf16, self.transposed):
            p.requires_grad_(False)


def _whole_float64(model: _Base) -> list[float]:
    """The fingerprint's definition, computed the expensive way: whole float64 copies."""
    frozen = [p.detach().double() for p in model.parameters() if not p.requires_grad]
    return [
        float(sum(w.numel() for w in frozen)),
        float(sum(w.sum() for w in frozen)),
        float(sum((w * w).sum() for w in frozen)),
    ]


def test_fingerprint_is_count_sum_and_sum_of_squares_of_the_frozen_tensors():
    """Slices that do not divide the tensors (1000 elements; rows of 512 transposed) add up to
    the whole-tensor float64 sums to float64 round-off; the trainable tensor is left out."""
    model = _Base(big=3 * 2**16 + 7 * 512 * 4)
    assert not model.transposed.is_contiguous()
    want = _whole_float64(model)
    for slice_elements in (1000, FINGERPRINT_SLICE):
        got = base_fingerprint([model], slice_elements=slice_elements)
        assert got[0] == want[0] == model.dense.numel() + 257 * 129 + model.transposed.numel()
        for a, b in zip(got[1:], want[1:], strict=True):
            assert abs(a - b) <= 1e-12 * abs(b), (slice_elements, a, b)
    # Another base differs by far more than the resume check's relative 1e-9.
    other = base_fingerprint([_Base(big=3 * 2**16 + 7 * 512 * 4, seed=1)])
    assert abs(other[1] - want[1]) > 1e-3 * abs(want[1])


def test_fingerprint_holds_no_full_size_copy():
    """The allocations while fingerprinting a 40 MiB base rise by at most one float64 slice
    (8 MiB) and a slice-sized block of the non-contiguous tensor — a float64 copy of the largest
    tensor alone would be 64 MiB (the former `.double()` of every tensor: 64 MiB + its square)."""
    model = _Base(big=2**23)  # dense: 32 MiB fp32, transposed: 8 MiB fp32
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_bytes > 40 * MIB
    with AllocationTrace() as trace:
        for _ in range(2):  # the smallest rise guards against a free the trace missed
            with trace.window():
                base_fingerprint([model])
    bound = FINGERPRINT_SLICE * (8 + 4) + MIB  # float64 slice + fp32 block + scalars
    assert trace.smallest_rise <= bound, (trace.smallest_rise, bound)
    assert trace.smallest_rise < model_bytes / 3  # the former: 128 MiB, 3x the model


def test_fingerprint_in_the_runs_dtype_matches_a_half_precision_base():
    """A bf16 run fingerprints its base as bf16; the same base rebuilt in float32 (the
    `--merge-lora` export) gives that fingerprint with `dtype=bfloat16` — each slice rounded as
    casting the model to bf16 rounds it — and not without (it differs by more than 1e-9)."""
    model = _Base(big=3 * 2**16 + 7 * 512 * 4)
    half = _Base(big=3 * 2**16 + 7 * 512 * 4)
    half.load_state_dict(model.state_dict())
    half.to(torch.bfloat16)
    want = base_fingerprint([half])
    got = base_fingerprint([model], slice_elements=1000, dtype=torch.bfloat16)
    assert got[0] == want[0]
    for a, b in zip(got[1:], want[1:], strict=True):
        assert abs(a - b) <= 1e-12 * abs(b), (a, b)
    plain = base_fingerprint([model])
    assert abs(plain[2] - want[2]) > 1e-9 * abs(want[2])
