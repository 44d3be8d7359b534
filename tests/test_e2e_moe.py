"""KTO on a converted Qwen3-MoE: expert parallelism changes where experts live, not the numbers.

A tiny random `transformers` Qwen3-MoE (4 experts, 2 routed per token, decisive routers) with the
bundled tokenizer's vocabulary is imported with `tools/convert_checkpoint.py`; `examples/
train_gpt_kto.py` then trains 3 steps from it on 2 ranks (DP=2) with EP=1 and with EP=2, and on
4 ranks with TP=2 x EP=2 (sequence parallel), PP=2 x EP=2 (DP=2: the same global batch) and
TP=2 x PP=2 (sequence parallel, DP=1), and with an expert tensor parallelism of its own: TP=2
(sequence parallel) x EP=2 x ETP=1 on 2 ranks (the TP ranks split the whole experts) and
TP=1 x EP=2 x ETP=2 on 4 ranks (each expert split over two data-parallel ranks); the router
load-balancing loss is on in all of them (under
PP its statistics are shared between the stages: the logged value is the whole model's).
Every logged training metric and every exported weight of the EP runs equals the EP=1 run's to
fp32 round-off (the reduction order differs, nothing else), as do runs with the other two
reference strategies (`separate`, `precomputed`; EP=1's is `cpu_swap`). The aux loss itself equals
`transformers`' on the same rows (KTO and DPO); EP=2 in bf16 follows the fp32 run to bf16
precision; a resume under EP is bitwise, one at another EP continues the run (EP 2 -> 1 and
1 -> 2, either optimizer), a checkpoint saved at ETP=2 resumes at ETP=1 (weights and optimizer
state, standard and distributed), and a launch with an expert count EP does not divide, or an
expert hidden size ETP does not divide, fails with one `error:` line.
The same model with a dense layer 1 (`mlp_only_layers=[1]`) trains the same at EP=2 and PP=2 as
at EP=1.
"""

from __future__ import annotations

import math

import pytest
import torch
from e2e_cli import KTO_SCRIPT, QUIET, REPO, TOKENIZER, TRAIN_DATA, launch, read_metrics, run_script
from hf_tiny import tiny_qwen3_moe_config

pytestmark = pytest.mark.e2e

TOOL = REPO / "tools" / "convert_checkpoint.py"
TP2SP = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
#: name -> (ranks, extra overrides); EP=1 on the same 2 ranks is the reference. The router
#: load-balancing loss (HF's router_aux_loss_coef) is on in every run.
RUNS = {
    "ep1": (2, ["model.expert_model_parallel_size=1"]),
    "ep2": (2, ["model.expert_model_parallel_size=2"]),
    "ep2tp2": (
        4,
        [
            "model.expert_model_parallel_size=2",
            "model.tensor_model_parallel_size=2",
            "model.sequence_parallel=true",  # megatron-core trains MoE x TP only with SP
        ],
    ),
    "ep2pp2": (4, ["model.expert_model_parallel_size=2", "model.pipeline_model_parallel_size=2"]),
    # Expert tensor parallelism apart from TP: EP=2 across the two TP ranks, each holding two
    # whole experts (ETP=1, DP=1, as tp2pp2); and each expert split over two data-parallel
    # ranks (TP=1, ETP=2, EP=2, DP=4).
    "tp2ep2etp1": (
        2,
        [*TP2SP, "model.expert_tensor_parallel_size=1", "model.expert_model_parallel_size=2"],
    ),
    "etp2ep2": (4, ["model.expert_tensor_parallel_size=2", "model.expert_model_parallel_size=2"]),
    # The same at EP=1 (experts marked expert-parallel at every EP size, see
    # training_setup.mark_experts_expert_parallel): TP=2 with whole experts, and TP=1 with each
    # expert split over the two data-parallel ranks.
    "tp2etp1": (2, [*TP2SP, "model.expert_tensor_parallel_size=1"]),
    "etp2": (2, ["model.expert_tensor_parallel_size=2"]),
    # TP x PP on 4 ranks (DP=1: the same global batch in 4 micro-batches of 2, as EP=1's two
    # ranks' 2 x 2): the balance statistics are summed over TP (sequence parallel) and stages.
    "tp2pp2": (
        4,
        [
            "model.tensor_model_parallel_size=2",
            "model.sequence_parallel=true",
            "model.pipeline_model_parallel_size=2",
        ],
    ),
    # The other two reference strategies (EP=1's is the default, cpu_swap): same steps.
    "ref_separate": (2, ["model.kto.reference_policy=separate"]),
    "ref_precomputed": (2, ["model.kto.reference_policy=precomputed"]),
    # bf16 weights with fp32 master weights in the distributed optimizer, at EP=2.
    "ep2_bf16": (
        2,
        [
            "model.expert_model_parallel_size=2",
            "trainer.precision=bf16",
            "model.optim.name=distributed_fused_adam",
        ],
    ),
    # One micro-batch of the whole global batch, padded and packed, for the aux-loss value.
    "aux_padded": (1, ["model.micro_batch_size=8", "model.data.pack_sequences=false"]),
    "aux_packed": (1, ["model.micro_batch_size=8", "model.data.pack_sequences=true"]),
    # The same model with its layer 1 dense (HF `mlp_only_layers=[1]`): EP=1 from its imported
    # checkpoint; EP=2 from the Hugging Face directory itself, writing hf/ at the end.
    "mixed_ep1": (2, ["model.expert_model_parallel_size=1"]),
    "mixed_ep2": (2, ["model.expert_model_parallel_size=2", "exp_manager.save_hf=true"]),
    # PP=2 (DP=1): the MoE layer on stage 0, the dense one on stage 1, which has no router and
    # shares zero statistics; the aux loss is still the whole model's.
    "mixed_pp2": (2, ["model.pipeline_model_parallel_size=2"]),
}
#: Runs of the mixed dense / MoE model (`mixed/`) instead of the all-MoE one, and what they start
#: from (its imported checkpoint or its Hugging Face directory).
MIXED = {"mixed_ep1": "mcore", "mixed_ep2": "hf", "mixed_pp2": "mcore"}
REFERENCE = {
    "ep2": "ep1",
    "ep2tp2": "ep1",
    "ep2pp2": "ep1",
    "tp2pp2": "ep1",
    "tp2ep2etp1": "ep1",
    "etp2ep2": "ep1",
    "tp2etp1": "ep1",
    "etp2": "ep1",
    "ref_separate": "ep1",
    "ref_precomputed": "ep1",
    "mixed_ep2": "mixed_ep1",
    "mixed_pp2": "mixed_ep1",
}
AUX_COEF = 0.01
#: fp32 round-off: the data-parallel gradient reduction order differs, so weights differ in their
#: last bits and summed completion log-probs (~60, fp32 ulp ~4e-6) by an ulp or two; rewards and
#: kl are differences of such sums (x beta), so they get an absolute tolerance of that size.
METRIC_RTOL, METRIC_ATOL, WEIGHT_ATOL = 1e-5, 5e-6, 1e-6
COMPARED = ("rewards/", "logps/", "logits/", "loss", "kl", "lr", "grad_norm", "aux_loss")


def _args(root, log_dir, source: str = "mcore") -> list[str]:
    return [
        *QUIET,
        f"pretrained_checkpoint.restore_from_path={root / source}",
        f"model.data.data_prefix.train=[{TRAIN_DATA}]",
        "model.tokenizer.library=sentencepiece",
        f"model.tokenizer.model={TOKENIZER}",
        "trainer.precision=32",
        f"exp_manager.explicit_log_dir={log_dir}",
        "trainer.kto.max_steps=3",
        "model.global_batch_size=8",
        "model.micro_batch_size=2",
        "model.data.shuffle=false",
        "model.data.max_length=64",
        "model.data.data_prefix.validation=[]",
        "model.optim.sched.warmup_steps=0",
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(root, metrics): the imported model's directory and a mapping that runs each of `RUNS`
    (and exports it) the first time a test asks for its metrics."""
    from transformers import AutoModelForCausalLM

    from megatron_kto.data.tokenizers import load_tokenizer

    root = tmp_path_factory.mktemp("moe")
    vocab = load_tokenizer("sentencepiece", str(TOKENIZER)).vocab_size

    def save(directory, **extra):
        torch.manual_seed(0)
        config = tiny_qwen3_moe_config(vocab, router_aux_loss_coef=AUX_COEF, **extra)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("gate.weight"):
                    p.normal_(0.0, 1.0)
        model.save_pretrained(directory / "hf")
        run_script(
            TOOL, ["import", "--hf-dir", str(directory / "hf"), "--out", str(directory / "mcore")]
        )

    save(root)

    class Runs(dict):
        def __missing__(self, name: str) -> list[dict]:
            nproc, extra = RUNS[name]
            log_dir = root / name
            model_root, source = root, "mcore"
            if name in MIXED:
                model_root, source = root / "mixed", MIXED[name]
                if not (model_root / "mcore").exists():
                    save(model_root, mlp_only_layers=[1])
            args = [*_args(model_root, log_dir, source), *extra]
            run_script(KTO_SCRIPT, args, nproc=nproc, timeout=600)
            if not name.startswith("aux"):
                out = root / f"{name}_hf"
                run_script(TOOL, ["export", "--ckpt", str(log_dir), "--out", str(out)])
            self[name] = read_metrics(log_dir)
            return self[name]

    return root, Runs()


def _weights(directory):
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


def _hf_aux_loss(root) -> float:
    """Hugging Face's `aux_loss` on the first global batch's rows as TRL feeds them: whole
    sequences (prompt + completion, final token included), right-padded, with their attention
    mask."""
    from transformers import AutoModelForCausalLM

    from megatron_kto.data.dataset import build_kto_dataset
    from megatron_kto.data.tokenizers import load_tokenizer

    tok = load_tokenizer("sentencepiece", str(TOKENIZER))
    dataset, _ = build_kto_dataset([TRAIN_DATA], tok, 64, use_cache=False)
    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    rows = [list(dataset[i]["prompt_ids"]) + list(dataset[i]["completion_ids"]) for i in range(8)]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        result = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    return result.aux_loss.item()


@pytest.mark.parametrize("name", ["aux_padded", "aux_packed"])
def test_aux_loss_and_loss_equal_transformers(runs, name):
    root, metrics = runs
    expected = _hf_aux_loss(root)
    first = metrics[name][0]
    print(f"{name}: aux {first['aux_loss']:.7f}, HF on the whole rows {expected:.7f}")
    assert first["aux_loss"] == pytest.approx(expected, rel=1e-5)
    # Step 1: policy == reference and z0 = 0, so every KTO row loss is 1 - sigmoid(0) = 0.5;
    # the logged loss (as TRL's) adds the coefficient times the aux loss.
    assert first["loss"] == pytest.approx(0.5 + AUX_COEF * expected, rel=1e-6)


@pytest.mark.parametrize(
    "name",
    [
        "ep2",
        "ep2tp2",
        "ep2pp2",
        "tp2pp2",
        "tp2ep2etp1",
        "etp2ep2",
        "tp2etp1",
        "etp2",
        "ref_separate",
        "ref_precomputed",
        "mixed_ep2",
        "mixed_pp2",
    ],
)
def test_layouts_and_reference_strategies_equal_ep1(runs, name):
    root, metrics = runs
    reference, got = metrics[REFERENCE[name]], metrics[name]
    model_root = root / "mixed" if name in MIXED else root
    assert len(got) == len(reference) == 3
    for ref_row, row in zip(reference, got, strict=True):
        # The numbers of the step (not timings, throughput or memory, which depend on layout).
        numeric = {k for k in ref_row if k.startswith(COMPARED)}
        assert {"loss", "grad_norm", "kl", "logps/chosen"} <= numeric
        assert "aux_loss" in numeric
        for key in sorted(numeric):
            assert row[key] == pytest.approx(ref_row[key], rel=METRIC_RTOL, abs=METRIC_ATOL), key
    start, ref_w, got_w = (
        _weights(model_root / "hf"),
        _weights(root / f"{REFERENCE[name]}_hf"),
        _weights(root / f"{name}_hf"),
    )
    assert ref_w.keys() == got_w.keys() == start.keys()
    for key in ref_w:
        diff = (ref_w[key] - got_w[key]).abs().max().item()
        assert diff <= WEIGHT_ATOL, (key, diff)
    experts = [k for k in ref_w if ".experts." in k]
    assert experts and all(not torch.equal(ref_w[k], start[k]) for k in experts)  # all trained
    if name in MIXED:  # layer 1's dense MLP is in the export, and trained
        dense = [k for k in ref_w if k.startswith("model.layers.1.mlp.")]
        assert sorted(k.split(".")[-2] for k in dense) == ["down_proj", "gate_proj", "up_proj"]
        assert all(not torch.equal(ref_w[k], start[k]) for k in dense)
    if name == "mixed_ep2":
        # The hf/ the run wrote at EP=2 is its checkpoint's export, bit for bit, with the
        # source's dense layer in its config.json.
        import json

        written = _weights(root / name / "hf")
        assert written.keys() == got_w.keys()
        assert all(torch.equal(written[k], got_w[k]) for k in got_w)
        config = json.loads((root / name / "hf" / "config.json").read_text())
        assert (config["mlp_only_layers"], config["decoder_sparse_step"]) == ([1], 1)


#: bf16 against fp32: bf16 keeps 8 mantissa bits (relative step 2**-8 = 3.9e-3 per value); sums
#: of ~60 token log-probs and the aux loss's averages of router probabilities stay within a few
#: steps of that. A router computed on wrongly rounded logits moves the aux loss by far more.
BF16_RTOL = 2e-2


def test_bf16_at_ep2_follows_fp32(runs):
    """EP=2 in bf16 (distributed optimizer, fp32 master weights) trains the same steps as the
    fp32 EP=1 run to bf16 precision: loss, aux loss, log-probs; kl (a clamped mean of
    differences near 0) to an absolute tolerance of the same size."""
    _, metrics = runs
    reference, got = metrics["ep1"], metrics["ep2_bf16"]
    assert len(got) == len(reference) == 3
    for ref_row, row in zip(reference, got, strict=True):
        for key in ("loss", "aux_loss", "logps/chosen", "logps/rejected", "kl"):
            assert math.isfinite(row[key]), key
            tolerance = {"abs": BF16_RTOL} if key == "kl" else {"rel": BF16_RTOL}
            assert row[key] == pytest.approx(ref_row[key], **tolerance), (row["step"], key)


@pytest.mark.parametrize(
    "override,line",
    [
        (
            "model.expert_model_parallel_size=3",
            "model.expert_model_parallel_size: 3 does not divide",
        ),
        (
            "model.expert_tensor_parallel_size=5",
            "model.expert_tensor_parallel_size: 5 does not divide the experts' hidden size 48",
        ),
    ],
)
def test_an_expert_layout_that_does_not_fit_is_one_error_line(runs, tmp_path, override, line):
    root, _ = runs
    args = [str(KTO_SCRIPT), *_args(root, tmp_path / "bad"), override]
    proc, _ = launch(args, nproc=1, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines[-1].startswith(f"error: {line}")


def test_eval_tool_at_ep2_and_etp1_equals_ep1(runs, tmp_path):
    import json

    from e2e_cli import EVAL_TOOL, VALIDATION_DATA

    root, metrics = runs
    metrics["ep2"]  # the run whose checkpoint is evaluated
    reports = {}
    # EP=1, EP=2, and TP=2 with whole experts per rank (ETP=1; forward passes need no EP).
    layouts = {
        "ep1": ["--expert-model-parallel-size", "1"],
        "ep2": ["--expert-model-parallel-size", "2"],
        "tp2etp1": ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
    }
    for name, flags in layouts.items():
        out = tmp_path / f"{name}.json"
        args = ["--policy", str(root / "ep2"), "--data", str(VALIDATION_DATA), "--json", str(out)]
        run_script(EVAL_TOOL, [*args, *flags], nproc=2)
        reports[name] = json.loads(out.read_text())
    numbers = {k for k, v in reports["ep1"].items() if isinstance(v, float)}
    assert {"auc", "accuracy", "margin", "mean_reward_desirable"} <= numbers, reports["ep1"]
    for name in ("ep2", "tp2etp1"):
        for key in numbers:
            want = reports["ep1"][key]
            assert reports[name][key] == pytest.approx(want, rel=1e-5, abs=1e-6), (name, key)


def _run_and_copy(root, tmp_path, extra: list[str]) -> list[str]:
    """Train 4 steps saving every 2 into `straight`; copy only its step-2 checkpoint into
    `resumed`. Returns the same arguments pointing at `resumed`."""
    import shutil

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = [
        *_args(root, straight),
        "trainer.kto.max_steps=4",
        "trainer.kto.save_interval=2",
        "exp_manager.checkpoint_callback_params.save_top_k=-1",
        *extra,
    ]
    run_script(KTO_SCRIPT, args, nproc=2, timeout=600)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    (resumed / "checkpoints" / "latest").write_text("step_2\n")
    return [a.replace(str(straight), str(resumed)) for a in args]


def _resumed_rows_and_weights(tmp_path):
    """(uninterrupted metrics by step, resumed metrics, uninterrupted weights, resumed weights)."""
    from megatron_kto.hf_writer.convert import export_hf

    for name in ("straight", "resumed"):
        export_hf(tmp_path / name, tmp_path / f"{name}_hf")
    want = {r["step"]: r for r in read_metrics(tmp_path / "straight")}
    got = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in got] == [3, 4]
    return want, got, _weights(tmp_path / "straight_hf"), _weights(tmp_path / "resumed_hf")


RESUME_KEYS = ("loss", "aux_loss", "grad_norm", "kl", "logps/chosen", "rewards/rejected")


def test_resume_under_ep2_is_bitwise(runs, tmp_path):
    """EP=2 with the distributed optimizer, 4 steps saving every 2; a copy holding only the
    step-2 checkpoint resumes to step 4 with bitwise-equal metrics and weights."""
    root, _ = runs
    extra = ["model.optim.name=distributed_fused_adam", "model.expert_model_parallel_size=2"]
    run_script(KTO_SCRIPT, _run_and_copy(root, tmp_path, extra), nproc=2, timeout=600)
    want, got, a, b = _resumed_rows_and_weights(tmp_path)
    for row in got:
        for key in RESUME_KEYS:
            assert row[key] == want[row["step"]][key], key
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("saved_ep", "resumed_ep", "optim"),
    [(2, 1, "distributed_fused_adam"), (1, 2, "fused_adam")],
)
def test_resume_at_another_ep_continues_the_run(runs, tmp_path, saved_ep, resumed_ep, optim):
    """A step-2 checkpoint saved at one EP size resumes at the other (experts have their own
    optimizer at every EP size, so dist_checkpointing reshards their Adam state like their
    weights): steps 3-4 and the final weights equal the uninterrupted run's to fp32 round-off
    (the data-parallel reduction order differs)."""
    root, _ = runs
    saved = f"model.expert_model_parallel_size={saved_ep}"
    redirected = _run_and_copy(root, tmp_path, [f"model.optim.name={optim}", saved])
    resumed = [
        f"model.expert_model_parallel_size={resumed_ep}" if a == saved else a for a in redirected
    ]
    run_script(KTO_SCRIPT, resumed, nproc=2, timeout=600)
    want, got, a, b = _resumed_rows_and_weights(tmp_path)
    for row in got:
        for key in RESUME_KEYS:
            assert row[key] == pytest.approx(
                want[row["step"]][key], rel=METRIC_RTOL, abs=METRIC_ATOL
            ), (row["step"], key)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=WEIGHT_ATOL, msg=k)


def test_ep1_checkpoint_with_experts_in_the_dense_optimizer_is_one_error_line(runs, tmp_path):
    """An EP=1 checkpoint written before experts had their own optimizer (its checkpoint.json
    lacks `experts_own_optimizer`) is refused in one line instead of failing in megatron-core."""
    import json

    from megatron_kto.checkpointing import files

    root, _ = runs
    redirected = _run_and_copy(root, tmp_path, ["model.expert_model_parallel_size=1"])
    meta_file = tmp_path / "resumed" / "checkpoints" / "step_2" / "checkpoint.json"
    meta = json.loads(meta_file.read_text())
    assert meta.pop("experts_own_optimizer") is True
    meta_file.write_text(json.dumps(meta))
    files.write_manifest(meta_file.parent)  # as the older version wrote it: a whole checkpoint
    refused, _ = launch([str(KTO_SCRIPT), *redirected], 2)
    assert refused.returncode != 0  # torchrun reports the ranks' exit code 2 as 1
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "kept the experts in the dense optimizer" in errors[0], errors


@pytest.mark.parametrize("optimizer", ["fused_adam", "distributed_fused_adam"])
def test_resume_at_another_expert_tensor_parallel_size(runs, tmp_path, optimizer):
    """A checkpoint saved with experts (and their Adam moments) split two ways resumes with
    whole experts: 3 steps at TP=1 x EP=2 x ETP=2 saving every step, the step-1 checkpoint
    resumed at ETP=1 for steps 2-3 (step 3 is the first whose numbers depend on the resharded
    moments); megatron-core's dist_checkpointing reshards weights and optimizer state (the
    distributed optimizer's too), so metrics and exported weights equal the EP=1 run's to fp32
    round-off."""
    import shutil

    from megatron_kto.hf_writer.convert import export_hf

    root, metrics = runs
    reference = metrics["ep1"]
    optim = f"model.optim.name={optimizer}"
    ep2 = "model.expert_model_parallel_size=2"
    saved, resumed = tmp_path / "saved", tmp_path / "resumed"
    every_step = [
        "trainer.kto.save_interval=1",
        "exp_manager.checkpoint_callback_params.save_top_k=-1",
    ]
    args = [*_args(root, saved), *every_step, optim, ep2]
    run_script(KTO_SCRIPT, [*args, "model.expert_tensor_parallel_size=2"], nproc=4, timeout=600)
    # Resumed with the same max_steps as the saved run: the LR schedule is the same.
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(saved / "checkpoints" / "step_1", resumed / "checkpoints" / "step_1")
    (resumed / "checkpoints" / "latest").write_text("step_1\n")
    args = [*_args(root, resumed), optim, ep2, "model.expert_tensor_parallel_size=1"]
    run_script(KTO_SCRIPT, args, nproc=4, timeout=600)
    got = read_metrics(resumed)
    assert [r["step"] for r in got] == [2, 3]
    for ref_row, row in zip(reference[1:], got, strict=True):
        for key in sorted(k for k in ref_row if k.startswith(COMPARED)):
            assert row[key] == pytest.approx(ref_row[key], rel=METRIC_RTOL, abs=METRIC_ATOL), key
    export_hf(resumed, tmp_path / "resumed_hf")
    a, b = _weights(root / "ep1_hf"), _weights(tmp_path / "resumed_hf")
    for key in a:
        assert (a[key] - b[key]).abs().max().item() <= WEIGHT_ATOL, key


def test_dpo_aux_loss_equals_transformers(runs, tmp_path):
    """DPO: each micro-batch (its pairs' chosen and rejected rows in one forward, as TRL's
    concatenated pass, whole sequences) adds coef x HF's aux loss; the step's aux_loss is the mean over the two
    micro-batches, and the step-1 loss is ln 2 + coef x aux_loss."""
    import math

    from transformers import AutoModelForCausalLM

    from megatron_kto.data.dataset import build_dpo_dataset
    from megatron_kto.data.tokenizers import load_tokenizer

    root, _ = runs
    data = REPO / "examples" / "data" / "tiny_dpo" / "train.jsonl"
    args = [a for a in _args(root, tmp_path / "dpo") if not a.startswith("trainer.kto")]
    args = [
        a
        if not a.startswith("model.data.data_prefix.train")
        else f"model.data.data_prefix.train=[{data}]"
        for a in args
    ]
    script = REPO / "examples" / "train_gpt_dpo.py"
    run_script(script, [*args, "trainer.dpo.max_steps=1", "model.micro_batch_size=4"], timeout=600)
    first = read_metrics(tmp_path / "dpo")[0]

    dataset, _ = build_dpo_dataset(
        [data], load_tokenizer("sentencepiece", str(TOKENIZER)), 64, use_cache=False
    )
    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    values = []
    for start in (0, 4):
        items = [dataset[i] for i in range(start, start + 4)]
        rows = [
            list(it["prompt_ids"]) + list(it[k])
            for k in ("chosen_ids", "rejected_ids")
            for it in items
        ]
        ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        with torch.no_grad():
            values.append(
                model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss.item()
            )
    expected = sum(values) / 2
    assert first["aux_loss"] == pytest.approx(expected, rel=1e-5)
    assert first["loss"] == pytest.approx(math.log(2) + AUX_COEF * expected, rel=1e-6)
