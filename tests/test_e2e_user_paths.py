"""What a user runs, from a Hugging Face chat model to a trained, evaluated checkpoint.

A tiny `transformers` Llama with grouped-query attention (6 heads over 3 key/value groups) and a
ChatML-style tokenizer, made here (`hf_tiny.py`), as a Hugging Face directory (and a copy
converted with `tools/convert_checkpoint.py`). Then, as a user would:

- the README's GPU command — read from README.md, verbatim except sizes and paths — trains the
  Hugging Face directory itself under `torchrun --nproc_per_node 2` (PP=2, bf16) and writes its
  `hf/` output, and `tools/eval_kto_rewards.py` evaluates the result;
- the same command with TP=2 (which does not divide the checkpoint's 3 query groups), and the
  evaluation tool with `--tensor-model-parallel-size 2`, stop with one `error:` line printed once
  (rank 0), exit code 2, before megatron-core is imported;
- the bundled example's normal start prints none of the third-party banners or deprecation
  warnings, and no MFU it cannot vouch for (CPU: no known peak);
- `trainer.precision=16-mixed` (fp16 with dynamic loss scaling) follows the example's fp32 run.

Independent launches run two at a time (each is mostly imports).
"""

from __future__ import annotations

import re
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from e2e_cli import EVAL_TOOL, KTO_SCRIPT, REPO, launch, read_metrics, run_script
from hf_tiny import make_hf_chat_model, write_kto_rows

pytestmark = pytest.mark.e2e

#: Output that must not appear on a normal start (third-party noise, or a crash).
NOISE = (
    "Detected Megatron Core",
    "Using Megatron-FSDP",
    "Warning:",  # UserWarning / FutureWarning / DeprecationWarning lines from `warnings`
    "not installed",
    "Traceback",
    "Error executing job",
)


def readme_gpu_command() -> list[str]:
    """The README's `torchrun ... examples/train_gpt_kto.py` block, as argv."""
    text = (REPO / "README.md").read_text()
    match = re.search(r"```bash\n(torchrun --nproc_per_node \d+ examples/train_gpt_kto\.py.*?)```",
                      text, re.S)  # fmt: skip
    assert match, "README.md lost its GPU torchrun command"
    return shlex.split(match.group(1).replace("\\\n", " "))


def adapted_readme_command(ckpt: Path, train: Path, val: Path, run: Path, tp: int, pp: int):
    """The README command with this machine's sizes and this test's paths; any other change to
    the README command makes the test fail (it must keep running as written)."""
    argv = readme_gpu_command()
    sizes = {
        "model.tensor_model_parallel_size": str(tp),
        "model.pipeline_model_parallel_size": str(pp),
        "model.global_batch_size": "8",
    }
    paths = {
        "pretrained_checkpoint.restore_from_path": str(ckpt),
        "model.data.data_prefix.train": f"[{train}]",
        "model.data.data_prefix.validation": f"[{val}]",
        "exp_manager.explicit_log_dir": str(run),
    }
    kept = {"trainer.precision": "bf16", "model.micro_batch_size": "1",
            "exp_manager.save_hf": "true"}  # fmt: skip
    assert argv[:3] == ["torchrun", "--nproc_per_node", "8"] and argv[3].endswith(KTO_SCRIPT.name)
    overrides = []
    for arg in argv[4:]:
        key, value = arg.split("=", 1)
        if key in kept:
            assert value == kept[key], f"README changed {arg}"
            overrides.append(arg)
        else:
            assert key in sizes or key in paths, f"README has a new override {arg}"
            overrides.append(f"{key}={sizes.get(key) or paths[key]}")
    return overrides


def _launch(args: list[str], nproc: int, logs: Path | None = None) -> dict:
    """Run a script; under torchrun each rank's streams go to files under `logs`."""
    started = time.monotonic()
    proc, ranks = launch(args, nproc, timeout=600, logs=logs)
    return {
        "returncode": proc.returncode,
        "stdout": proc.stdout,
        "stderr": proc.stderr,
        "ranks": ranks,
        "seconds": time.monotonic() - started,
    }


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("user_paths")
    make_hf_chat_model(root / "hf")
    run_script(REPO / "tools" / "convert_checkpoint.py",
               ["import", "--hf-dir", str(root / "hf"), "--out", str(root / "mcore")])  # fmt: skip
    train = write_kto_rows(root / "data" / "train.jsonl", 0, 16)  # 2 global batches of 8
    val = write_kto_rows(root / "data" / "val.jsonl", 900, 8)
    return root, root / "hf", train, val


@pytest.fixture(scope="module")
def results(paths):
    root, ckpt, train, val = paths
    script = str(KTO_SCRIPT)
    jobs = {
        "readme": (
            [script, *adapted_readme_command(ckpt, train, val, root / "run", tp=1, pp=2)], 2),
        "readme_tp2": (
            [script, *adapted_readme_command(ckpt, train, val, root / "run_tp2", tp=2, pp=1)], 2),
        "eval_tp2": (
            [str(EVAL_TOOL), "--policy", str(root / "mcore"), "--reference", str(root / "mcore"),
             "--data", str(val), "--tokenizer", str(root / "mcore"), "--tokenizer-library", "huggingface", "--beta", "0.1",
             "--tensor-model-parallel-size", "2"], 2),
        "example": (
            [script, f"exp_manager.explicit_log_dir={root / 'example'}", "trainer.kto.max_steps=2",
             "trainer.kto.limit_val_batches=1"], 1),
        "fp16": (
            [script, f"exp_manager.explicit_log_dir={root / 'fp16'}", "trainer.kto.max_steps=2",
             "trainer.kto.limit_val_batches=1", "trainer.precision=16-mixed"], 1),
    }  # fmt: skip
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(_launch, args, nproc, root / f"logs_{name}")
            for name, (args, nproc) in jobs.items()
        }
        out = {name: f.result() for name, f in futures.items()}
    # The trained run, evaluated as the README says (settings from the run's saved config).
    out["eval"] = _launch([str(EVAL_TOOL), "--policy", str(root / "run")], 1)
    for name, result in out.items():
        print(f"{name}: exit {result['returncode']} in {result['seconds']:.1f} s")
    return root, out


def _clean(text: str) -> None:
    for noise in NOISE:
        assert noise not in text, f"{noise!r} in:\n{text[-3000:]}"


def test_readme_gpu_command_trains_a_hugging_face_gqa_model(results):
    root, out = results
    result = out["readme"]
    assert result["returncode"] == 0, result["stderr"][-3000:]
    (stdout0, stderr0), (stdout1, stderr1) = result["ranks"]
    assert "done: step 2, consumed 16 samples" in stdout0
    assert "note: trainer.precision=bf16 on a CPU" in stdout0  # said once, by rank 0
    assert stdout0.count("note: trainer.precision=bf16") == 1 and "note:" not in stdout1
    # Where start-up time went, once, by rank 0, before the first step.
    startup = re.search(
        r"^start-up \d+\.\d s: imports .*, optimizer and restore \d+\.\d s$", stdout0, re.M
    )
    assert startup and "start-up" not in stdout1
    assert startup.start() < stdout0.index("[train] step 1/")
    assert stderr0.strip() == "" and stderr1.strip() == ""
    for text in (stdout0, stdout1):
        _clean(text)
    train, val = read_metrics(root / "run"), read_metrics(root / "run", "val")
    assert [r["step"] for r in train] == [1, 2] and val  # val_check_interval 0.1 of an epoch
    assert train[0]["rewards/chosen"] == 0.0  # policy == reference before the first update
    assert "mfu" not in train[0]  # CPU: no known peak, no MFU
    assert (root / "run" / "checkpoints" / "latest").exists()
    assert (root / "run" / "hf" / "config.json").is_file()  # exp_manager.save_hf=true


def test_evaluating_the_trained_run(results):
    _, out = results
    result = out["eval"]
    assert result["returncode"] == 0, result["stderr"][-3000:]
    assert re.search(r"^AUC: [01]\.\d{4}$", result["stdout"], re.M), result["stdout"]
    assert "examples: 8 (3 desirable, 5 undesirable)" in result["stdout"]
    _clean(result["stdout"] + result["stderr"])


@pytest.mark.parametrize(
    "name,expected",
    [
        ("readme_tp2", "error: model.tensor_model_parallel_size: 2 does not divide the 3 query "
                       "groups in {root}/hf/config.json"),
        ("eval_tp2", "error: --tensor-model-parallel-size: 2 does not divide the 3 query groups "
                     "in {root}/mcore/architecture.json"),
    ],
)  # fmt: skip
def test_layout_errors_are_one_line_printed_once(results, name, expected):
    root, out = results
    result = out[name]
    (stdout0, stderr0), (stdout1, stderr1) = result["ranks"]
    assert stderr0.strip().splitlines() == [expected.format(root=root)]
    assert stderr1.strip() == "" and "Traceback" not in stdout0 + stdout1
    assert "exitcode  : 2" in result["stderr"]  # torchrun's report of rank 0
    assert not (root / "run_tp2").exists()  # stopped before writing anything
    print(f"{name}: launch to exit {result['seconds']:.1f} s")


def test_bundled_example_console_is_quiet(results):
    root, out = results
    result = out["example"]
    assert result["returncode"] == 0, result["stderr"][-3000:]
    _clean(result["stdout"] + result["stderr"])
    assert result["stderr"].strip() == ""
    assert (
        "note: no training data and no checkpoint given: running the bundled tiny example"
        in (result["stdout"])
    )
    assert all("mfu" not in row for row in read_metrics(root / "example"))


def test_fp16_with_loss_scaling_follows_fp32(results):
    """16-mixed: fp16 weights and compute, fp32 master weights, dynamic loss scaling. Same
    starting weights and batches as the bundled example's fp32 run: no skipped step, log-probs
    and gradient norms within fp16's precision."""
    root, out = results
    assert out["fp16"]["returncode"] == 0, out["fp16"]["stderr"][-3000:]
    _clean(out["fp16"]["stdout"] + out["fp16"]["stderr"])
    fp32, fp16 = read_metrics(root / "example"), read_metrics(root / "fp16")  # fp32: the example
    assert [r["skipped_step"] for r in fp16] == [0.0, 0.0]
    for a, b in zip(fp32, fp16, strict=True):
        assert b["logps/chosen"] == pytest.approx(a["logps/chosen"], rel=1e-3)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-2)
    assert fp16[-1]["rewards/margins"] == pytest.approx(fp32[-1]["rewards/margins"], rel=5e-2)
