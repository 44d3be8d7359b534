"""A bad configuration or data file stops the entry script with one `error:` line, no traceback.

Each case launches `examples/train_gpt_kto.py` (or the reward-evaluation tool) as a user would
and checks: exit code 2, exactly one line on stderr — printed once, by rank 0, under torchrun —
starting with `error:` and naming the config key or the file:line, no traceback anywhere in the
output, and — for config errors — nothing written to the run directory (the run stopped before
building anything).

The cases are independent single-process start-ups dominated by imports, so the module fixture
runs them two at a time.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from e2e_cli import (
    CONF,
    EVAL_TOOL,
    KTO_SCRIPT,
    QUIET,
    TINY_EXAMPLE,
    TRAIN_DATA,
    launch,
)

pytestmark = pytest.mark.e2e

RUN_DIR = "<run_dir>"


def _bad_rows(tmp: Path) -> tuple[Path, Path]:
    """A JSONL file whose 4th line is cut off, and one whose 3rd row has a non-boolean label."""
    good = TRAIN_DATA.read_text().splitlines()[:40]
    truncated = tmp / "truncated.jsonl"
    truncated.write_text(
        "\n".join(good[:3] + ['{"prompt": "Name two fruit words .", '] + good[3:]) + "\n"
    )
    bad_label = tmp / "bad_label.jsonl"
    row = json.loads(good[2]) | {"label": "maybe"}
    bad_label.write_text("\n".join(good[:2] + [json.dumps(row)] + good[3:]) + "\n")
    return truncated, bad_label


def _typo_config_dir(tmp: Path) -> Path:
    """A copy of conf/ whose gpt_kto.yaml has a misspelt key under exp_manager."""
    conf = tmp / "conf"
    shutil.copytree(CONF, conf)
    yaml = conf / "gpt_kto.yaml"
    text = yaml.read_text()
    line = "  explicit_log_dir: results/gpt_kto\n"
    assert line in text
    yaml.write_text(text.replace(line, line + "  explicit_log_dri: results/x\n"))
    return conf


def _cases(tmp: Path) -> dict[str, tuple[list[str], int, str]]:
    """name -> (command line after the launcher, ranks, expected stderr line prefix)."""
    truncated, bad_label = _bad_rows(tmp)
    missing = tmp / "no_such_dir" / "train.jsonl"

    def train(*overrides: str) -> list[str]:
        # The bundled example, explicitly: cases that name a data file stay on its tokenizer
        # and model instead of becoming a real run that lacks them.
        return [
            str(KTO_SCRIPT),
            *QUIET,
            TINY_EXAMPLE,
            f"exp_manager.explicit_log_dir={RUN_DIR}",
            *overrides,
        ]

    return {
        "unknown_key_override": (
            train("model.kto.loss_typ=kto"),
            1,
            "error: model.kto.loss_typ: unknown config key (did you mean 'loss_type'?)",
        ),
        "unknown_key_appended": (
            train("+model.kto.sft_weight=0.5"),
            1,
            "error: model.kto.sft_weight: unknown config key",
        ),
        "unknown_key_in_yaml": (
            [str(KTO_SCRIPT), "--config-path", str(_typo_config_dir(tmp)), *train()[1:]],
            1,
            "error: exp_manager.explicit_log_dri: unknown config key (did you mean "
            "'explicit_log_dir'?)",
        ),
        "wrong_value_type": (
            train("model.micro_batch_size=four"),
            1,
            "error: model.micro_batch_size: Value 'four' of type 'str' could not be converted",
        ),
        "global_batch_not_divisible": (
            train(
                "model.global_batch_size=10",
                "model.micro_batch_size=4",
            ),
            1,
            "error: model.global_batch_size: 10 is not divisible by micro_batch_size (4) x "
            "data-parallel size (1)",
        ),
        "global_batch_not_divisible_dp2": (
            train(
                "model.global_batch_size=6",
                "model.micro_batch_size=2",
            ),
            2,
            "error: model.global_batch_size: 6 is not divisible by micro_batch_size (2) x "
            "data-parallel size (2)",
        ),
        "tp_does_not_divide_heads": (
            train(
                "model.tensor_model_parallel_size=2",
                "model.num_attention_heads=3",
                "model.num_query_groups=null",
                "model.hidden_size=96",
            ),
            2,
            "error: model.num_attention_heads: 3 heads not divisible by TP=2",
        ),
        "unknown_attention_backend": (
            train("model.attention_backend=flash"),
            1,
            "error: model.attention_backend: must be one of ['auto', 'te', 'sdpa', 'local'], "
            "got 'flash'",
        ),
        "missing_data_file": (
            train(f"model.data.data_prefix.train=[{missing}]"),
            1,
            f"error: model.data.data_prefix.train: {missing} does not exist",
        ),
        "malformed_jsonl_row": (
            train(
                f"model.data.data_prefix.train=[{truncated}]",
                "model.data.use_cache=false",
            ),
            1,
            f"error: {truncated}:4: <json>: malformed JSON",
        ),
        # The rank that tokenises reports the row; the rank waiting for its cache stays quiet.
        "malformed_jsonl_row_dp2": (
            train(
                f"model.data.data_prefix.train=[{truncated}]",
                "model.data.use_cache=true",
            ),
            2,
            f"error: {truncated}:4: <json>: malformed JSON",
        ),
        "bad_label_row": (
            train(
                f"model.data.data_prefix.train=[{bad_label}]",
                "model.data.use_cache=false",
            ),
            1,
            f"error: {bad_label}:3: label: expected true or false, got string 'maybe'",
        ),
        "eval_tool_missing_policy": (
            [str(EVAL_TOOL), "--policy", str(tmp / "no_run")],
            1,
            f"error: --policy: {tmp / 'no_run'} not found",
        ),
    }


def _run(tmp: Path, name: str, args: list[str], nproc: int) -> dict:
    args = [a.replace(RUN_DIR, str(tmp / name)) for a in args]  # one run directory per case
    # torchrun prints its own launcher traceback when a worker fails; the workers' streams go
    # to files so that what our code wrote can be checked on its own.
    proc, ranks = launch(args, nproc, timeout=300, logs=tmp / f"torchrun_{name}")
    streams = ranks if nproc > 1 else [(proc.stdout, proc.stderr)]
    return {"returncode": proc.returncode, "streams": streams, "launcher": proc.stderr}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli_errors")
    cases = _cases(tmp)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(_run, tmp, name, args, nproc)
            for name, (args, nproc, _) in cases.items()
        }
        out = {name: f.result() for name, f in futures.items()}
    return tmp, cases, out


CASE_NAMES = [
    "unknown_key_override",
    "unknown_key_appended",
    "unknown_key_in_yaml",
    "wrong_value_type",
    "global_batch_not_divisible",
    "global_batch_not_divisible_dp2",
    "tp_does_not_divide_heads",
    "unknown_attention_backend",
    "missing_data_file",
    "malformed_jsonl_row",
    "malformed_jsonl_row_dp2",
    "bad_label_row",
    "eval_tool_missing_policy",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_one_error_line_no_traceback(results, name):
    tmp, cases, out = results
    args, nproc, expected = cases[name]
    result = out[name]
    assert result["returncode"] != 0
    assert len(result["streams"]) == nproc
    (stdout, stderr), *others = result["streams"]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"stderr of {name}:\n{stderr}"
    assert lines[0].startswith(expected), lines[0]
    for out, err in result["streams"]:
        assert "Traceback" not in out + err
    # The other ranks found the same error and stayed quiet: it is printed once.
    assert all(not err.strip() for _, err in others), others
    if nproc == 1:
        assert result["returncode"] == 2
    else:  # torchrun's report names rank 0's exit code
        assert "exitcode  : 2" in result["launcher"], result["launcher"][-2000:]
    # The run stopped before it built a model or wrote any output.
    assert not (tmp / name / "metrics.jsonl").exists()
    assert not (tmp / name / "checkpoints").exists()


def test_every_case_is_checked(results):
    assert sorted(results[1]) == sorted(CASE_NAMES)
