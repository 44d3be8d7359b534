"""LoRA on the attention of a mixture-of-experts model, as a user runs it, against TRL + `peft`.

A tiny random `transformers` Qwen3-MoE (`hf_tiny.make_hf_qwen3_moe`: 2 layers, 4 experts, top-2,
decisive routers, `router_aux_loss_coef` 0.1) is imported with `tools/convert_checkpoint.py`. A
`peft` adapter on q/k/v/o (rank 4, alpha 8, B non-zero so that A learns from step 1) is the
starting adapter of every run (`model.peft.restore_from_path`, `model.peft.reference=base`);
`examples/train_gpt_kto.py` trains it for 4 steps with the experts and routers frozen.

* Reference: TRL 1.16's `KTOTrainer(model=base, peft_config=<q/k/v/o LoraConfig>)` with the
  starting adapter's weights loaded into its fresh adapter. TRL enables the router loss for a
  `PeftModel` exactly as for a plain model (`aux_loss_enabled`: the config has
  `output_router_logits`; the coefficient is the config's) and adds `coef · aux_loss` of the
  policy's forward to each batch's loss; the routers are frozen, but their inputs depend on the
  adapted attention, so that term's gradient reaches the adapters. One rank, one micro-batch of
  the whole batch of 8 (TRL's aux loss is joint over its batch): step losses and aux losses equal
  TRL's to 1e-5 relative, the final adapters to fp32 round-off; and a TRL run without the router
  loss ends elsewhere by far more than that (the aux gradient does reach the adapters).
* Expert parallelism: the same run at TP=2 (sequence parallel) x EP=2 on 2 ranks (DP=1, the same
  micro-batch of 8) logs the same metrics and ends with the same adapters; EP=2 on 2 ranks
  (DP=2, micro-batches of 4; 2 steps, then resumed from that checkpoint: the base fingerprint
  each rank checks covers every rank's experts) equals EP=1 on one rank with two micro-batches
  of 4.
* Export: the runs' `hf/` (`exp_manager.save_hf=true`) and `tools/convert_checkpoint.py export`
  of the EP=2 x DP=2 checkpoint are PEFT adapter directories that `peft.PeftModel.from_pretrained`
  loads onto `Qwen3MoeForCausalLM`, giving our model's log-probs (base + adapters, rebuilt at TP=1
  from the LoRA checkpoint); the merged exports (`exp_manager.save_hf_merged=true` of the one-rank
  and the TP2 x EP2 run) load as plain `transformers` models with the same log-probs.
* The start-up line "LoRA: <trainable> of <total> parameters" is the same at every layout (each
  expert counted once, wherever EP puts it). Adapters on the experts are refused with one line
  naming the key (`test_lora_config.py`).

Batches are taken in data order, each reversed for TRL (`trl_harness`: TRL pairs each prompt with
the previous row's completion for its KL rows, we with the next one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from e2e_cli import KTO_SCRIPT, REPO, launch, read_metrics, run_script
from hf_tiny import make_hf_qwen3_moe, write_kto_rows
from multirank import run_multirank
from trl_harness import (
    LoRARun,
    imported_run,
    in_order_trainer,
    kl_aligned_dataset,
    kto_args,
    start_adapter,
    trl_optimizer_overrides,
)

pytestmark = pytest.mark.e2e
trl = pytest.importorskip("trl")
pytest.importorskip("peft")

TOOL = REPO / "tools" / "convert_checkpoint.py"
STEPS, BATCH, ROWS = 4, 8, 32
BETA, LR, EPS, CLIP, AUX_COEF = 0.1, 1e-3, 1e-5, 1.0, 0.1
RANK, ALPHA = 4, 8
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj"]
#: fp32 round-off (see `test_e2e_moe.py` for why rewards and kl get an absolute tolerance too).
LOSS_RTOL, METRIC_ATOL, WEIGHT_RTOL, LOGP_ATOL = 1e-5, 5e-6, 1e-4, 1e-4
COMPARED = ("rewards/", "logps/", "logits/", "loss", "kl", "grad_norm", "aux_loss")
#: name -> (ranks, overrides). `one` is the TRL-comparable run.
RUNS = {
    "one": (1, ["model.micro_batch_size=8", "exp_manager.save_hf_merged=true"]),
    "tp2ep2": (
        2,
        [
            "model.micro_batch_size=8",
            "model.tensor_model_parallel_size=2",
            "model.sequence_parallel=true",
            "model.expert_model_parallel_size=2",
            "model.expert_tensor_parallel_size=1",
            "exp_manager.save_hf_merged=true",
        ],
    ),
    "ep1_mb4": (1, ["model.micro_batch_size=4"]),
    "ep2_dp2": (2, ["model.micro_batch_size=4", "model.expert_model_parallel_size=2"]),
}
#: Runs trained in two legs: half the steps, then resumed from that checkpoint.
RESUMED = ("ep2_dp2",)


def _trl(root: Path, coef: float | None) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """TRL's logged steps and final adapter (`coef`: TRL's `router_aux_loss_coef`, None = the
    model config's)."""
    from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = kl_aligned_dataset(root / "train.jsonl", BATCH)
    base = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(root / "hf")
    args = kto_args(root / "trl", batch=BATCH, steps=STEPS, lr=LR, eps=EPS, clip=CLIP, beta=BETA)
    args.router_aux_loss_coef = coef
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=PROJECTIONS)
    trainer = in_order_trainer()(
        model=base, args=args, train_dataset=data, processing_class=tokenizer, peft_config=lora
    )
    assert trainer.aux_loss_enabled == (coef != 0.0)
    weights = load_file(str(root / "adapter0" / "adapter_model.safetensors"))
    assert not set_peft_model_state_dict(trainer.model, weights).unexpected_keys
    trainer.train()
    state = {
        k.replace(".default", ""): v.detach().clone()
        for k, v in get_peft_model_state_dict(trainer.model).items()
    }
    return [e for e in trainer.state.log_history if "loss" in e], state


def _args(root: Path, name: str) -> list[str]:
    return [
        str(KTO_SCRIPT),
        *imported_run(root, name),
        "exp_manager.save_hf=true",
        f"trainer.kto.max_steps={STEPS}",
        f"trainer.kto.gradient_clip_val={CLIP}",
        f"model.global_batch_size={BATCH}",
        f"model.kto.ref_policy_kl_penalty={BETA}",
        *trl_optimizer_overrides(LR, EPS),
        "model.peft.peft_scheme=lora",
        f"model.peft.lora_tuning.adapter_dim={RANK}",
        f"model.peft.lora_tuning.alpha={ALPHA}",
        "model.peft.lora_tuning.target_modules=[attention_qkv,attention_dense]",
        f"model.peft.restore_from_path={root / 'adapter0'}",
        "model.peft.reference=base",
    ]


def _adapter(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| of any tensor, relative to that tensor's largest |b|."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


def _tokens() -> torch.Tensor:
    return torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(3))


def _ours_worker(rank: int, world_size: int, run_dirs: list[str]) -> list[torch.Tensor]:
    """Log-probs of our model (base + a run's adapters, from its LoRA checkpoint) at TP=1, for
    each run."""
    from megatron_kto.checkpointing.locate import resolve_pretrained_dir
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
    from megatron_kto.peft.checkpoint import build_lora_model
    from megatron_kto.runtime import init_runtime, teardown

    rt = init_runtime(1, 1, seed=0)
    tokens = _tokens()
    out = []
    for run_dir in run_dirs:
        ckpt = resolve_pretrained_dir(run_dir)
        arch = read_architecture(ckpt)
        chunks = build_gpt_chunks(arch, ParallelLayout(), rt.device)
        build_lora_model(ckpt, chunks, arch)
        with torch.no_grad():
            logits = unwrap(chunks[0]).eval()(
                tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None
            )
        out.append(torch.log_softmax(logits[..., : arch.vocab_size].float(), dim=-1))
    teardown()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_moe")
    make_hf_qwen3_moe(root / "hf", AUX_COEF)
    write_kto_rows(root / "train.jsonl", 0, ROWS)
    start_adapter(root, LoRARun(tuple(PROJECTIONS), RANK, ALPHA))
    run_script(TOOL, ["import", "--hf-dir", str(root / "hf"), "--out", str(root / "mcore")])
    for name, (nproc, extra) in RUNS.items():
        legs = [[f"trainer.kto.max_steps={STEPS // 2}"], []] if name in RESUMED else [[]]
        for leg in legs:
            proc, _ = launch([*_args(root, name), *extra, *leg], nproc, timeout=600)
            assert proc.returncode == 0, f"{name}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        (root / f"{name}.out").write_text(proc.stdout)
    run_script(TOOL, ["export", "--ckpt", str(root / "ep2_dp2"), "--out", str(root / "ep2_cli")])
    return root


def test_steps_and_adapters_equal_trl(runs):
    root = runs
    trl_steps, theirs = _trl(root, None)
    _, without_aux = _trl(root, 0.0)
    metrics = read_metrics(root / "one")
    for key in ("loss", "aux_loss"):
        ours, ref = [r[key] for r in metrics], [e[key] for e in trl_steps]
        print(f"\n{key}: ours {ours}\n{key}: trl  {ref}")
        assert len(ours) == len(ref) == STEPS
        assert ours == pytest.approx(ref, rel=LOSS_RTOL)
    assert metrics[0]["rewards/chosen"] != 0.0  # the starting adapter is not the base
    ours, start = _adapter(root / "one" / "hf"), _adapter(root / "adapter0")
    assert ours.keys() == theirs.keys() == start.keys()
    worst, aux_effect = _max_rel(ours, theirs), _max_rel(without_aux, theirs)
    moved = _max_rel(theirs, start)
    print(f"adapters vs TRL {worst:.1e}; TRL without aux {aux_effect:.1e}; moved {moved:.1e}")
    assert worst <= WEIGHT_RTOL
    assert aux_effect > 10 * WEIGHT_RTOL and moved > 10 * WEIGHT_RTOL


@pytest.mark.parametrize("run,reference", [("tp2ep2", "one"), ("ep2_dp2", "ep1_mb4")])
def test_expert_parallel_equals_ep1(runs, run, reference):
    root = runs
    got, ref = read_metrics(root / run), read_metrics(root / reference)
    assert len(got) == len(ref) == STEPS
    for a, b in zip(got, ref, strict=True):
        for key in (k for k in b if k.startswith(COMPARED)):
            assert a[key] == pytest.approx(b[key], rel=LOSS_RTOL, abs=METRIC_ATOL), (run, key)
    ours, theirs = _adapter(root / run / "hf"), _adapter(root / reference / "hf")
    assert ours.keys() == theirs.keys()
    worst = _max_rel(ours, theirs)
    print(f"\n{run}: adapters vs {reference} {worst:.1e}")
    assert worst <= WEIGHT_RTOL


def test_exports_load_in_transformers_with_our_logprobs(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = runs
    ours = dict(
        zip(
            ("one", "ep2_dp2"),
            run_multirank(_ours_worker, 1, [str(root / "one"), str(root / "ep2_dp2")])[0],
            strict=True,
        )
    )

    def logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model.eval()(_tokens()).logits.float(), dim=-1)

    def base():
        return AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)

    assert type(base()).__name__ == "Qwen3MoeForCausalLM"
    effect = (ours["one"] - logprobs(base())).abs().max().item()
    print(f"\nadapter effect on log-probs {effect:.2e}")
    assert effect > 100 * LOGP_ATOL
    for run, adapter in (("one", "one/hf"), ("ep2_dp2", "ep2_dp2/hf"), ("ep2_dp2", "ep2_cli")):
        got = logprobs(PeftModel.from_pretrained(base(), root / adapter))
        diff = (got - ours[run]).abs().max().item()
        print(f"peft + {adapter}: {diff:.1e}")
        assert diff <= LOGP_ATOL, adapter
    for merged in ("one/hf_merged", "tp2ep2/hf_merged"):
        model = AutoModelForCausalLM.from_pretrained(root / merged, dtype=torch.float32)
        diff = (logprobs(model) - ours["one"]).abs().max().item()
        print(f"{merged}: {diff:.1e}")
        assert diff <= LOGP_ATOL, merged


def test_parameter_counts_are_the_whole_model_at_every_layout(runs):
    """The start-up line counts every expert once, wherever EP/TP put it, and the adapters'
    parameters are those of the `peft` adapter."""
    root = runs
    lines = {
        name: [
            line
            for line in (root / f"{name}.out").read_text().splitlines()
            if " trainable of " in line
        ]
        for name in RUNS
    }
    assert all(len(found) == 1 for found in lines.values()), lines
    assert len({found[0] for found in lines.values()}) == 1, lines
    adapter = sum(t.numel() for t in _adapter(root / "adapter0").values())
    assert f"LoRA: {adapter:,} trainable of " in lines["one"][0]
