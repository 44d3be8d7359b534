"""A new user's walk with a DeepSeek-V3-style model (`deepseek_v3`), and expert parallelism
changing where experts live, not the numbers.

A tiny Hugging Face directory (`hf_tiny.TINY_DEEPSEEK_V3` with groups: multi-latent
attention with a query bottleneck and YaRN, a dense first layer, 8 sigmoid-routed experts top-4 in
4 groups of which 2 are eligible, a shared expert, non-zero expert-score correction biases) and
the bundled example's rows -> `python examples/train_gpt_kto.py
pretrained_checkpoint.restore_from_path=<hf dir> ... exp_manager.save_hf=true`, 2 steps, at
EP=1 (2 ranks, DP=2; the reference), EP=2 (2 ranks), PP=2 x EP=2 (4 ranks) and TP=2 (sequence
parallel) x EP=2 x ETP=1 (2 ranks: the TP ranks split whole experts). Every logged metric and
every `hf/` weight equals EP=1's to fp32 round-off; a step-1 checkpoint saved at EP=2 resumed at
EP=1, and one saved at EP=1 resumed at EP=2, continue the run (step 2 and `hf/` equal);
`transformers` loads EP=1's `hf/` (DeepseekV3ForCausalLM) and generates, and its log-probs and
expert choices equal those of our model restored from the run's checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import family_parity as fp
import pytest
import torch
from e2e_cli import KTO_SCRIPT, QUIET, read_metrics, run_script
from hf_tiny import hf_tensors, make_hf_sigmoid_routed, write_kto_rows
from multirank import run_multirank

pytestmark = pytest.mark.e2e

STEPS = 2
TP2SP = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
EP2 = "model.expert_model_parallel_size=2"
EVERY_STEP = ["trainer.kto.save_interval=1", "exp_manager.checkpoint_callback_params.save_top_k=-1"]
#: name -> (ranks, extra overrides); EP=1 on the same 2 ranks is the reference. EP=1 and EP=2 save
#: every step: each one's step-1 checkpoint is resumed at the other EP size (`RESUMED`).
RUNS = {
    "ep1": (2, EVERY_STEP),
    "ep2": (2, [EP2, *EVERY_STEP]),
    "pp2ep2": (4, [EP2, "model.pipeline_model_parallel_size=2"]),
    "tp2ep2etp1": (2, [*TP2SP, EP2, "model.expert_tensor_parallel_size=1"]),
}
#: resumed run -> (the run whose step-1 checkpoint it resumes, its expert-parallel size)
RESUMED = {"ep2_to_ep1": ("ep2", 1), "ep1_to_ep2": ("ep1", 2)}
LR = 1e-3
#: fp32 round-off (as tests/test_e2e_moe.py): the reduction orders differ, nothing else.
METRIC_RTOL, METRIC_ATOL, WEIGHT_ATOL = 1e-5, 5e-6, 1e-6
#: Under TP (vocab-parallel head, sequence-parallel reductions) gradients differ from EP=1's by
#: more round-off, and Adam divides each element by its own gradient's size: an element whose two
#: steps nearly cancel, or whose gradient is small, turns that round-off into a fraction of a
#: step. Measured: 6 of 161,160 elements over 1e-6, scattered over six tensors (head, dense,
#: routed and shared experts, q_a_proj), the largest 8.4e-6 = 0.8 % of one step of `LR`.
TP_WEIGHT_ATOL = 2e-2 * LR
#: What depends on the machine and the layout, not on the step: everything else is compared.
TIMINGS = {"step_time", "tokens_per_sec", "samples_per_sec", "peak_memory_gb", "mfu"}


def _make_deepseek(directory: Path) -> None:
    make_hf_sigmoid_routed(
        directory, "deepseek_v3", n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2
    )


def _args(root: Path, log_dir: Path) -> list[str]:
    return [
        *QUIET,
        f"pretrained_checkpoint.restore_from_path={root / 'hf_in'}",
        f"model.data.data_prefix.train=[{root / 'train.jsonl'}]",
        "model.data.data_prefix.validation=[]",
        "trainer.precision=32",
        f"exp_manager.explicit_log_dir={log_dir}",
        f"trainer.kto.max_steps={STEPS}",
        "model.global_batch_size=8",
        "model.micro_batch_size=2",
        # Steps far larger than fp32 round-off: the weights move ~1e-3, the rewards ~1e-2.
        f"model.optim.lr={LR}",
        "model.optim.sched.warmup_steps=0",
        "exp_manager.save_hf=true",
    ]


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    """The root holding `hf_in/` and each run of `RUNS` and `RESUMED`."""
    root = tmp_path_factory.mktemp("deepseek_walk")
    _make_deepseek(root / "hf_in")
    write_kto_rows(root / "train.jsonl", 0, 32)
    for name, (nproc, extra) in RUNS.items():
        run_script(KTO_SCRIPT, [*_args(root, root / name), *extra], nproc=nproc, timeout=600)
    for name, (source, ep) in RESUMED.items():
        resumed = root / name / "checkpoints"
        resumed.mkdir(parents=True)
        shutil.copytree(root / source / "checkpoints" / "step_1", resumed / "step_1")
        (resumed / "latest").write_text("step_1\n")
        extra = [f"model.expert_model_parallel_size={ep}"]
        run_script(KTO_SCRIPT, [*_args(root, root / name), *extra], nproc=2, timeout=600)
    return root


def _assert_rows_equal(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for ref_row, row in zip(want, got, strict=True):
        assert row.keys() == ref_row.keys()
        numeric = {k for k, v in ref_row.items() if isinstance(v, float | int)} - TIMINGS
        assert {"loss", "grad_norm", "kl", "logps/chosen", "load_imbalance/layer_1"} <= numeric
        for key in sorted(numeric):
            assert row[key] == pytest.approx(ref_row[key], rel=METRIC_RTOL, abs=METRIC_ATOL), (
                row["step"],
                key,
            )


def _assert_weights_equal(got: dict, want: dict, atol: float = WEIGHT_ATOL) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=atol, msg=key)


@pytest.mark.parametrize("name", [n for n in RUNS if n != "ep1"])
def test_layout_equals_ep1(walk, name):
    """Metrics of both steps and every `hf/` tensor equal EP=1's; the weights moved (experts,
    shared expert, MLA projections), the frozen correction biases did not."""
    reference = read_metrics(walk / "ep1")
    assert len(reference) == STEPS
    _assert_rows_equal(read_metrics(walk / name), reference)
    start, want = hf_tensors(walk / "hf_in"), hf_tensors(walk / "ep1" / "hf")
    atol = TP_WEIGHT_ATOL if name.startswith("tp") else WEIGHT_ATOL
    _assert_weights_equal(hf_tensors(walk / name / "hf"), want, atol)
    assert want.keys() == start.keys()
    for part in ("experts.", "shared_experts.", "q_a_proj", "kv_b_proj", "mlp.gate.weight"):
        moved = [k for k in want if part in k]
        assert moved and all(not torch.equal(want[k], start[k]) for k in moved), part
    biases = [k for k in want if k.endswith("e_score_correction_bias")]
    assert biases and all(torch.equal(want[k], start[k]) for k in biases)


@pytest.mark.parametrize("name", RESUMED)
def test_resume_at_another_ep_continues_the_run(walk, name):
    """A step-1 checkpoint saved at one EP size resumed at the other (weights and Adam state
    resharded): step 2 equals the uninterrupted run's, and so does `hf/`."""
    got = read_metrics(walk / name)
    assert [r["step"] for r in got] == [2]
    _assert_rows_equal(got, read_metrics(walk / RESUMED[name][0])[1:])
    _assert_weights_equal(hf_tensors(walk / name / "hf"), hf_tensors(walk / "ep1" / "hf"))


def _ours_worker(rank: int, world_size: int, log_dir: str) -> tuple:
    """Our model restored from the run's last checkpoint: log-probs and routing maps."""
    from megatron_kto.checkpointing.locate import resolve_pretrained_dir
    from megatron_kto.runtime import init_runtime, teardown

    rt = init_runtime(1, 1, seed=9)  # a different init: only the checkpoint can match
    result = fp.forward(*fp.restore_and_run(resolve_pretrained_dir(log_dir), fp.Layout(), rt))
    teardown()
    return result


def test_transformers_loads_hf_output_generates_and_equals_ours(walk):
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    out = walk / "ep1" / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3"
    assert (config["n_group"], config["topk_group"], config["q_lora_rank"]) == (4, 2, 16)
    model = fp.hf_model(out)
    assert isinstance(model, DeepseekV3ForCausalLM)
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("Hello there", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 5

    logits, choices = fp.hf_run(model)
    logprobs, maps = run_multirank(_ours_worker, 1, str(walk / "ep1"), timeout=600)[0]
    want = fp.reference_logprobs(logits)
    error = ((logprobs - want).abs() / want.abs().clamp(min=1.0)).max().item()
    print(f"trained deepseek_v3: max relative |Δ logp| ours vs transformers {error:.2e}")
    assert error <= fp.RELATIVE
    assert len(maps) == len(choices) == 1
    assert torch.equal(maps[0], choices[0])
