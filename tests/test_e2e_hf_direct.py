"""Training straight from a Hugging Face directory equals training from its converted checkpoint.

A tiny `transformers` Llama chat model with its tokenizer (`hf_tiny.py`: GQA 6:3, tied
embeddings, a ChatML template) is converted with `tools/convert_checkpoint.py import`. Then
`examples/train_gpt_kto.py` trains two steps twice — `pretrained_checkpoint.restore_from_path` the
converted checkpoint, and the Hugging Face directory itself — with the tokenizer taken from the
directory given (unset `model.tokenizer.model`) in both. The metrics of every step (losses, the
rewards against the reference policy, log-probs, gradient norms) and the trained weights must be
identical: the direct load gives the same weights, the same tokenizer and the same reference. The
same holds for a LoRA run (the base weights are the directory's, the reference is the base), and
for a third step resumed from the training checkpoint (a megatron checkpoint; the reference
rebuilt from the directory).

Then, as for converted checkpoints: the run started from the directory exports to Hugging Face
with its source's model type and tokenizer files (a LoRA run's exported adapter equals the converted
run's); `tools/eval_kto_rewards.py` evaluates against the directory as the reference; a layout the model cannot take (TP=2 over 3
query groups) and an unsupported model type stop with one `error:` line naming config.json,
exit code 2.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from e2e_cli import (
    EVAL_TOOL,
    KTO_SCRIPT,
    QUIET,
    REPO,
    launch,
    load_tp1_state_dicts,
    read_metrics,
    run_script,
)
from hf_tiny import make_hf_chat_model, write_kto_rows

pytestmark = pytest.mark.e2e

#: Metrics that time or measure the machine, not the model.
MEASURED = {"step_time", "tokens_per_sec", "samples_per_sec", "peak_memory_gb", "mfu"}
LORA = [
    "model.peft.peft_scheme=lora",
    "model.peft.lora_tuning.adapter_dim=4",
    "model.peft.lora_tuning.alpha=8",
    "model.peft.lora_tuning.target_modules=[all]",
    "model.peft.lora_tuning.column_init_method=kaiming",
]


def _args(ckpt, train, log_dir, extra=()) -> list[str]:
    return [
        str(KTO_SCRIPT),
        *QUIET,
        f"pretrained_checkpoint.restore_from_path={ckpt}",
        f"model.data.data_prefix.train=[{train}]",
        "model.data.data_prefix.validation=[]",
        "trainer.precision=32",
        f"exp_manager.explicit_log_dir={log_dir}",
        "trainer.kto.max_steps=2",
        "model.global_batch_size=8",
        "model.micro_batch_size=2",
        "model.data.shuffle=false",
        "model.data.max_length=64",
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_direct_e2e")
    hf = make_hf_chat_model(root / "hf")
    tool = REPO / "tools" / "convert_checkpoint.py"
    run_script(tool, ["import", "--hf-dir", str(hf), "--out", str(root / "mcore")])
    train = write_kto_rows(root / "data" / "train.jsonl", 0, 16)
    gpt2 = root / "gpt2"
    shutil.copytree(hf, gpt2)
    config = json.loads((gpt2 / "config.json").read_text()) | {"model_type": "gpt2"}
    (gpt2 / "config.json").write_text(json.dumps(config))
    jobs = {
        "converted": (_args(root / "mcore", train, root / "converted"), 1),
        "direct": (_args(hf, train, root / "direct"), 1),
        "converted_lora": (_args(root / "mcore", train, root / "converted_lora", LORA), 1),
        "direct_lora": (_args(hf, train, root / "direct_lora", LORA), 1),
        "gpt2": (_args(gpt2, train, root / "gpt2_run"), 1),
        "tp2": (_args(hf, train, root / "tp2", ["model.tensor_model_parallel_size=2"]), 2),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(launch, args, nproc, 600, root / f"logs_{name}")
            for name, (args, nproc) in jobs.items()
        }
        out = {name: f.result() for name, f in futures.items()}
    for name in ("converted", "direct", "converted_lora", "direct_lora"):
        proc = out[name][0]
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    resumes = {  # one more step: resumes from step 2, the reference rebuilt from the start
        name: ([*_args(ckpt, train, root / name), "trainer.kto.max_steps=3"], 1)
        for name, ckpt in (("converted", root / "mcore"), ("direct", hf))
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, future in [(n, pool.submit(launch, *job)) for n, job in resumes.items()]:
            proc = future.result()[0]
            assert proc.returncode == 0, f"{name} resume: {proc.stderr[-3000:]}"
    for name in ("direct", "converted_lora", "direct_lora"):
        run_script(tool, ["export", "--ckpt", str(root / name), "--out", str(root / f"{name}_hf")])
    for name in ("converted", "direct"):  # reference: the run's restore_from_path
        args = ["--policy", str(root / name), "--data", str(train), "--json", str(root / name)]
        run_script(EVAL_TOOL, [*args[:-1], str(root / f"{name}_eval.json")])
    return root, out


@pytest.mark.parametrize("pair", [("converted", "direct"), ("converted_lora", "direct_lora")])
def test_metrics_equal_the_converted_run(runs, pair):
    root, _ = runs
    want, got = (read_metrics(root / name) for name in pair)
    assert [r["step"] for r in got] == ([1, 2, 3] if pair[0] == "converted" else [1, 2])
    assert got[0]["rewards/chosen"] == 0.0  # the reference is the starting policy
    for a, b in zip(want, got, strict=True):
        for key, value in a.items():
            if key not in MEASURED:
                assert b[key] == value, (key, value, b[key])


def test_trained_weights_equal_the_converted_run(runs):
    root, _ = runs
    want, got = load_tp1_state_dicts([root / "converted", root / "direct"])
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_run_from_the_directory_exports_with_its_source(runs):
    root, _ = runs
    config = json.loads((root / "direct_hf" / "config.json").read_text())
    source = json.loads((root / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == source["vocab_size"]
    assert (root / "direct_hf" / "tokenizer.json").is_file()
    assert (root / "direct_hf" / "tokenizer_config.json").read_text() == (
        root / "hf" / "tokenizer_config.json"
    ).read_text()


def test_lora_run_on_the_directory_exports_the_same_adapter(runs):
    from safetensors.torch import load_file

    root, _ = runs
    want = load_file(root / "converted_lora_hf" / "adapter_model.safetensors")
    got = load_file(root / "direct_lora_hf" / "adapter_model.safetensors")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_evaluation_against_the_directory_as_reference(runs):
    """`tools/eval_kto_rewards.py` takes the run's restore_from_path as the reference: the
    directory itself, with the same rewards as against the converted checkpoint."""
    root, _ = runs
    want, got = (json.loads((root / f"{n}_eval.json").read_text()) for n in ("converted", "direct"))
    numbers = [k for k, v in want.items() if isinstance(v, int | float)]
    assert numbers and all(got[k] == want[k] for k in numbers), (want, got)


@pytest.mark.parametrize(
    "name,expected",
    [
        ("gpt2", "error: {root}/gpt2/config.json: model_type 'gpt2' is not supported (llama, "),
        ("tp2", "error: model.tensor_model_parallel_size: 2 does not divide the 3 query groups "
                "in {root}/hf/config.json"),
    ],
)  # fmt: skip
def test_bad_input_is_one_error_line(runs, name, expected):
    root, out = runs
    proc, ranks = out[name]
    stderr = ranks[0][1] if ranks else proc.stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected.format(root=root)), stderr[-2000:]
    assert "exitcode  : 2" in proc.stderr if ranks else proc.returncode == 2
    assert not (root / f"{name}_run").exists() and not (root / name / "checkpoints").exists()
