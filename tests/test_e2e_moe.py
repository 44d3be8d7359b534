"""KTO on a converted Qwen3-MoE: expert parallelism changes where experts live, not the numbers.

A tiny random `transformers` Qwen3-MoE (4 experts, 2 routed per token, decisive routers) with the
bundled tokenizer's vocabulary is imported with `tools/convert_checkpoint.py`; `examples/
train_gpt_kto.py` then trains 3 steps from it on 2 ranks (DP=2) with EP=1 and with EP=2, and on
4 ranks with TP=2 x EP=2 (sequence parallel), PP=2 x EP=2 (DP=2: the same global batch) and
TP=2 x PP=2 (sequence parallel, DP=1); the router load-balancing loss is on in all of them (under
PP its statistics are shared between the stages: the logged value is the whole model's).
Every logged training metric and every exported weight of the EP runs equals the EP=1 run's to
fp32 round-off (the reduction order differs, nothing else), as do runs with the other two
reference strategies (`separate`, `precomputed`; EP=1's is `cpu_swap`). The aux loss itself equals
`transformers`' on the same rows (KTO and DPO), a resume under EP is bitwise, and a launch
with an expert count EP does not divide fails with one `error:` line. The same model with a dense
layer 1 (`mlp_only_layers=[1]`) trains the same at EP=2 as at EP=1.
"""

from __future__ import annotations

import pytest
import torch
from e2e_cli import KTO_SCRIPT, QUIET, REPO, TOKENIZER, TRAIN_DATA, launch, read_metrics, run_script
from hf_tiny import tiny_qwen3_moe_config

pytestmark = pytest.mark.e2e

TOOL = REPO / "tools" / "convert_checkpoint.py"
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


def test_ep_not_dividing_the_experts_is_one_error_line(runs, tmp_path):
    root, _ = runs
    args = [str(KTO_SCRIPT), *_args(root, tmp_path / "bad"), "model.expert_model_parallel_size=3"]
    proc, _ = launch(args, nproc=1, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines[-1].startswith("error: model.expert_model_parallel_size: 3 does not divide")


def test_eval_tool_at_ep2_equals_ep1(runs, tmp_path):
    import json

    from e2e_cli import EVAL_TOOL, VALIDATION_DATA

    root, metrics = runs
    metrics["ep2"]  # the run whose checkpoint is evaluated
    reports = {}
    for ep in (1, 2):
        out = tmp_path / f"eval{ep}.json"
        args = ["--policy", str(root / "ep2"), "--data", str(VALIDATION_DATA), "--json", str(out)]
        run_script(EVAL_TOOL, [*args, "--expert-model-parallel-size", str(ep)], nproc=2)
        reports[ep] = json.loads(out.read_text())
    numbers = {k for k, v in reports[1].items() if isinstance(v, float)}
    assert {"auc", "accuracy", "margin", "mean_reward_desirable"} <= numbers, reports[1]
    for key in numbers:
        assert reports[2][key] == pytest.approx(reports[1][key], rel=1e-5, abs=1e-6), key


def test_resume_under_ep2_is_bitwise_and_another_ep_is_one_error_line(runs, tmp_path):
    """EP=2 with the distributed optimizer, 4 steps saving every 2; a copy holding only the
    step-2 checkpoint resumes to step 4 with bitwise-equal metrics and weights; resuming it at
    EP=1 is refused in one line (optimizer state does not convert between EP sizes)."""
    import shutil

    root, _ = runs
    args = [
        *_args(root, tmp_path / "straight"),
        "trainer.kto.max_steps=4",
        "trainer.kto.save_interval=2",
        "exp_manager.checkpoint_callback_params.save_top_k=-1",
        "model.optim.name=distributed_fused_adam",
    ]
    ep2 = "model.expert_model_parallel_size=2"
    run_script(KTO_SCRIPT, [*args, ep2], nproc=2, timeout=600)
    straight = tmp_path / "straight"
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    (resumed / "checkpoints" / "latest").write_text("step_2\n")
    redirected = [a.replace(str(straight), str(resumed)) for a in args]
    refused, _ = launch([str(KTO_SCRIPT), *redirected, "model.expert_model_parallel_size=1"], 2)
    assert refused.returncode != 0
    assert "cannot convert optimizer state between expert-parallel sizes" in refused.stderr
    run_script(KTO_SCRIPT, [*redirected, ep2], nproc=2, timeout=600)
    want = {r["step"]: r for r in read_metrics(straight)}
    got = read_metrics(resumed)
    assert [r["step"] for r in got] == [3, 4]
    for row in got:
        for key in ("loss", "aux_loss", "grad_norm", "kl", "logps/chosen", "rewards/rejected"):
            assert row[key] == want[row["step"]][key], key
    from megatron_kto.conversion.convert import export_hf

    for name in ("straight", "resumed"):
        export_hf(tmp_path / name, tmp_path / f"{name}_hf")
    a, b = _weights(tmp_path / "straight_hf"), _weights(tmp_path / "resumed_hf")
    assert all(torch.equal(a[k], b[k]) for k in a)


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
