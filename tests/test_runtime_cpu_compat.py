"""The CPU compatibility layer (`runtime/cpu_compat.py`) and `runtime/distributed.py`.

The patches change process-global torch state, so everything that needs them runs in one
2-rank spawn (`_worker`), never in the pytest process. Each rank first makes a private world
of one without the torchrun environment (single-process checks), then joins the 2-rank world
for the tensor-parallel RNG checks. Results come back as a dict of named facts per rank, and
each test below asserts one group of them.
"""

from __future__ import annotations

import pytest
import torch
from multirank import run_multirank, solo_world

from megatron_kto.runtime import cpu_compat

SEED = 1234
FACTORIES = ("zeros", "ones", "empty", "tensor", "empty_like", "zeros_like", "full", "arange")


# ---------------------------------------------------------------------------------------------
# In-process: version gate (no patching happens)
# ---------------------------------------------------------------------------------------------


def test_unsupported_version_is_refused_with_supported_range():
    with pytest.raises(cpu_compat.CPUCompatError) as err:
        cpu_compat.check_version("0.17.0")
    message = str(err.value)
    assert "0.17.0" in message, "names the version found"
    assert "0.16" in message and "<0.17" in message, "names the supported range"


@pytest.mark.parametrize("version", ["0.16.0", "0.16.1", "0.16.2rc0"])
def test_supported_versions_pass(version):
    cpu_compat.check_version(version)


def test_installed_version_is_supported():
    cpu_compat.check_version()


def test_apply_refuses_unsupported_version_before_patching(monkeypatch):
    monkeypatch.setattr(cpu_compat, "_APPLIED", False)
    monkeypatch.setattr(cpu_compat, "megatron_core_version", lambda: "0.15.3")
    zeros_before = torch.zeros
    with pytest.raises(cpu_compat.CPUCompatError, match="0.15.3"):
        cpu_compat.apply(force=True)
    assert torch.zeros is zeros_before, "nothing may be patched when the version is refused"
    assert not cpu_compat._APPLIED


# ---------------------------------------------------------------------------------------------
# Spawned: everything that needs the patches
# ---------------------------------------------------------------------------------------------


def _factory_checks() -> dict:
    """Each patched factory, given each spelling of a CUDA device megatron uses, makes CPU tensors."""
    like = torch.ones(3)
    calls = {
        "zeros": lambda d: torch.zeros(2, device=d),
        "ones": lambda d: torch.ones(2, device=d),
        "empty": lambda d: torch.empty(2, device=d),
        "tensor": lambda d: torch.tensor([1.0, 2.0], device=d),
        "empty_like": lambda d: torch.empty_like(like, device=d),
        "zeros_like": lambda d: torch.zeros_like(like, device=d),
        "full": lambda d: torch.full((2,), 7.0, device=d),
        "arange": lambda d: torch.arange(4, device=d),
    }
    spellings = ["cuda", "cuda:0", torch.device("cuda"), 0, torch.cuda.current_device()]
    return {
        f"{name}[{spelling!r}]": call(spelling).device.type
        for name, call in calls.items()
        for spelling in spellings
    }


def _device_context_checks() -> dict:
    """Each patched factory still obeys a `with torch.device(...)` context (no device given)."""
    like = torch.ones(3, device="meta")
    calls = {
        "zeros": lambda: torch.zeros(2),
        "ones": lambda: torch.ones(2),
        "empty": lambda: torch.empty(2),
        "tensor": lambda: torch.tensor([1.0, 2.0]),
        "empty_like": lambda: torch.empty_like(like),
        "zeros_like": lambda: torch.zeros_like(like),
        "full": lambda: torch.full((2,), 7.0),
        "arange": lambda: torch.arange(4),
    }
    with torch.device("meta"):
        return {name: call().device.type for name, call in calls.items()}


def _rng_restore_checks() -> dict:
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    facts: dict = {}
    # fork() twice from the same saved tracker state gives identical draws.
    saved = tracker.get_states()
    with tracker.fork():
        first = torch.rand(6)
    tracker.set_states(saved)
    with tracker.fork():
        second = torch.rand(6)
    facts["fork_replay_equal"] = torch.equal(first, second)
    # fork() leaves the default (CPU) stream where it was.
    before = torch.get_rng_state()
    with tracker.fork():
        torch.rand(100)
    facts["fork_restores_default_stream"] = torch.equal(before, torch.get_rng_state())
    # _set_cuda_rng_state really sets the CPU generator.
    state = mrandom._get_cuda_rng_state(clone=True)
    a = torch.rand(5)
    mrandom._set_cuda_rng_state(state)
    b = torch.rand(5)
    facts["set_cuda_rng_state_rewinds_cpu"] = torch.equal(a, b)
    torch.rand(3)
    facts["set_cuda_rng_state_changed_cpu_state"] = not torch.equal(torch.get_rng_state(), state)
    # torch.cuda.manual_seed seeds the CPU generator (not a no-op).
    torch.cuda.manual_seed(77)
    c = torch.rand(4)
    facts["cuda_manual_seed_seeds_cpu"] = torch.equal(
        c, torch.rand(4, generator=torch.Generator().manual_seed(77))
    )
    return facts


def _type_checks() -> dict:
    x = torch.zeros(2)
    return {
        "float": x.type(),
        "bf16": x.bfloat16().type(),
        "long": torch.zeros(2, dtype=torch.long).type(),
        "convert_dtype": x.type(torch.float64).dtype,
        "convert_str": x.type("torch.DoubleTensor").dtype,
        "cuda_is_identity": x.cuda() is x,
        "synchronize": torch.cuda.synchronize() is None,
        "current_device": str(torch.cuda.current_device()),
    }


def _causality_checks(tp_size: int) -> dict:
    """Logits at position j depend only on tokens <= j (megatron's default causal mask path)."""
    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
    from megatron_kto.models.logprobs import token_logprobs

    arch = GPTArchitecture(vocab_size=100, num_layers=2, encoder_seq_length=16, init_method_std=0.1)
    (model,) = build_gpt_chunks(
        arch, ParallelLayout(tensor_model_parallel_size=tp_size), torch.device("cpu")
    )
    model.eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (2, 12), generator=g)
    pos = torch.arange(12).expand(2, 12)
    k = 7
    changed = tokens.clone()
    changed[:, k:] = (tokens[:, k:] + 1 + torch.randint(0, 98, (2, 12 - k), generator=g)) % 100
    with torch.no_grad():
        la, lb = model(tokens, pos, None), model(changed, pos, None)
        lpa = token_logprobs(la.clone(), torch.roll(tokens, -1, dims=1))
        lpb = token_logprobs(lb.clone(), torch.roll(changed, -1, dims=1))
    return {
        "logits_prefix_diff": (la[:, :k] - lb[:, :k]).abs().max().item(),
        "logits_suffix_diff": (la[:, k:] - lb[:, k:]).abs().max().item(),
        # Position k-1 predicts token k, which changed; positions < k-1 must not move.
        "logprob_prefix_diff": (lpa[:, : k - 1] - lpb[:, : k - 1]).abs().max().item(),
        "logprob_at_changed_label_diff": (lpa[:, k - 1] - lpb[:, k - 1]).abs().max().item(),
    }


def _worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_kto.runtime import init_runtime, teardown

    facts: dict = {}
    # --- a private world of one, as in `python script.py` without torchrun ------------------
    with solo_world():
        rt = init_runtime(1, 1, seed=SEED)
        facts["solo"] = {
            "world_size": dist.get_world_size(),
            "rank": rt.rank,
            "backend": dist.get_backend(),
            "is_cpu": rt.is_cpu,
            "is_rank0": rt.is_rank0,
            "applied": cpu_compat.is_applied(),
            "dp_size": rt.data_parallel_size,
        }
        facts["factories"] = _factory_checks()
        facts["device_context"] = _device_context_checks()
        facts["type"] = _type_checks()
        facts["rng_restore"] = _rng_restore_checks()
        facts["causality_tp1"] = _causality_checks(tp_size=1)
        teardown()
        teardown()
        facts["teardown_twice"] = {
            "dist_initialized": dist.is_initialized(),
            "megatron_initialized": parallel_state.model_parallel_is_initialized(),
        }

    # --- the spawned 2-rank world: TP=2 ----------------------------------------------------
    rt = init_runtime(2, 1, seed=SEED)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork():  # the tensor-model-parallel stream
        tp_draw = torch.rand(8)
    with tracker.fork("data-parallel-rng"):
        dp_draw = torch.rand(8)
    default_draw = torch.rand(8)
    tp_expected = torch.rand(8, generator=torch.Generator().manual_seed(SEED + 2718 + rank))
    gathered = [torch.empty(3, 8) for _ in range(world_size)]
    dist.all_gather(gathered, torch.stack([tp_draw, dp_draw, default_draw]))
    facts["tp2"] = {
        "tp_rank": rt.tensor_parallel_rank,
        "tp_stream_differs": not torch.equal(gathered[0][0], gathered[1][0]),
        "tp_stream_is_seed_plus_2718_plus_tp_rank": torch.equal(tp_draw, tp_expected),
        "dp_stream_equal": torch.equal(gathered[0][1], gathered[1][1]),
        "default_stream_equal": torch.equal(gathered[0][2], gathered[1][2]),
    }
    facts["causality_tp2"] = _causality_checks(tp_size=2)
    teardown()
    return facts


@pytest.fixture(scope="module")
def facts() -> list[dict]:
    return run_multirank(_worker, 2, timeout=180)


def test_init_runtime_without_torchrun_env(facts):
    """No RANK/WORLD_SIZE/MASTER_*: a gloo world of one on the CPU, patches applied."""
    for f in facts:
        assert f["solo"] == {
            "world_size": 1,
            "rank": 0,
            "backend": "gloo",
            "is_cpu": True,
            "is_rank0": True,
            "applied": True,
            "dp_size": 1,
        }


def test_teardown_twice_is_safe(facts):
    for f in facts:
        assert f["teardown_twice"] == {"dist_initialized": False, "megatron_initialized": False}


def test_factories_map_cuda_to_cpu(facts):
    got = facts[0]["factories"]
    assert len(got) == len(FACTORIES) * 5
    assert set(got.values()) == {"cpu"}, {k: v for k, v in got.items() if v != "cpu"}


def test_factories_still_obey_device_context_managers(facts):
    """`with torch.device("meta")` must still reach the wrapped factories (transformers'
    from_pretrained relies on it; a stale identity set once made it load garbage RoPE buffers)."""
    got = facts[0]["device_context"]
    assert set(got) == set(FACTORIES)
    assert set(got.values()) == {"meta"}, got


def test_tensor_type_reports_cuda_names_and_still_converts(facts):
    t = facts[0]["type"]
    assert t["float"] == "torch.cuda.FloatTensor"
    assert t["bf16"] == "torch.cuda.BFloat16Tensor"
    assert t["long"] == "torch.cuda.LongTensor"
    assert t["convert_dtype"] == torch.float64
    assert t["convert_str"] == torch.float64
    assert t["cuda_is_identity"] and t["synchronize"]
    assert t["current_device"] == "cpu"


def test_rng_restore_really_restores(facts):
    for f in facts:
        assert f["rng_restore"] == {
            "fork_replay_equal": True,
            "fork_restores_default_stream": True,
            "set_cuda_rng_state_rewinds_cpu": True,
            "set_cuda_rng_state_changed_cpu_state": True,
            "cuda_manual_seed_seeds_cpu": True,
        }


def test_tensor_parallel_ranks_get_different_rng_streams(facts):
    """TP ranks: distinct tensor-parallel streams (seed + 2718 + tp_rank, as megatron intends);
    identical data-parallel and default streams."""
    assert [f["tp2"]["tp_rank"] for f in facts] == [0, 1]
    for f in facts:
        assert f["tp2"] == {
            "tp_rank": f["tp2"]["tp_rank"],
            "tp_stream_differs": True,
            "tp_stream_is_seed_plus_2718_plus_tp_rank": True,
            "dp_stream_equal": True,
            "default_stream_equal": True,
        }


@pytest.mark.parametrize("key", ["causality_tp1", "causality_tp2"])
def test_causality(facts, key):
    """Changing tokens from position k on leaves logits before k and log-probs before k-1
    unchanged, while the changed positions do change."""
    for f in facts:
        c = f[key]
        assert c["logits_prefix_diff"] <= 1e-6, c
        assert c["logprob_prefix_diff"] <= 1e-6, c
        assert c["logits_suffix_diff"] > 1e-3, c
        assert c["logprob_at_changed_label_diff"] > 1e-3, c
