"""`tools/eval_kto_rewards.py`: which precision and attention backend an evaluation uses.

The machine is stated (`Accelerator.detect` returns it); nothing is built. The tool's passes are
packed, so on Transformer Engine 2.9 an fp32 evaluation must not be given TE attention (which
has none for packed fp32 input) — the crash every evaluation hit in the NGC 25.11 image.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.runtime.gpu_settings import Accelerator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import eval_kto_rewards as tool  # noqa: E402

TE_2_9 = Accelerator(cuda=True, transformer_engine="2.9.0")
DATA = REPO / "examples" / "data" / "tiny_kto" / "validation.jsonl"
SP = REPO / "examples" / "data" / "tokenizer" / "tiny_sp.model"


def _state(monkeypatch, machine: Accelerator) -> None:
    monkeypatch.setattr(Accelerator, "detect", classmethod(lambda cls, read_device=False: machine))


def _policy(tmp_path: Path, precision: str | None, arch: GPTArchitecture | None = None) -> Path:
    """A checkpoint directory as the tool reads it: architecture.json and the run's config."""
    policy = tmp_path / "policy"
    policy.mkdir()
    arch = arch or GPTArchitecture()
    (policy / "architecture.json").write_text(json.dumps(arch.to_dict()))
    trainer = f"trainer:\n  precision: '{precision}'\n" if precision else ""
    (policy / "config.yaml").write_text(
        f"{trainer}pretrained_checkpoint:\n  restore_from_path: {policy}\n"
        f"model:\n  kto:\n    ref_policy_kl_penalty: 0.1\n"
        f"  tokenizer:\n    model: {SP}\n    library: sentencepiece\n"
        f"  data:\n    data_prefix:\n      validation: [{DATA}]\n"
    )
    return policy


def _settings(policy: Path, *flags: str) -> dict:
    args = tool.parse_args(["--policy", str(policy), *flags])
    return tool.resolve_settings(args, policy)


@pytest.mark.parametrize(
    "machine,run,flags,want",
    [
        (Accelerator(cuda=False), None, [], "32"),  # no run precision: follows the device
        (TE_2_9, None, [], "bf16"),
        (Accelerator(cuda=False), "bf16", [], "bf16"),  # the run's precision
        (TE_2_9, "32", [], "32"),
        (TE_2_9, "bf16", ["--precision", "32"], "32"),  # the flag wins
    ],
)
def test_precision(monkeypatch, tmp_path, machine, run, flags, want):
    _state(monkeypatch, machine)
    assert _settings(_policy(tmp_path, run), *flags)["precision"] == want


def test_fp32_evaluation_on_te_2_9_uses_sdpa(monkeypatch, tmp_path):
    _state(monkeypatch, TE_2_9)
    fp32 = tool.choose_attention(_settings(_policy(tmp_path, "32")))
    assert fp32.describe().startswith("sdpa (Transformer Engine 2.9.0: its flash and fused")
    (tmp_path / "b").mkdir()
    assert tool.choose_attention(_settings(_policy(tmp_path / "b", "bf16"))).backend == "te"


def test_the_tool_decides_from_the_models_whole_attention(monkeypatch, tmp_path):
    """As the model builder will: a sliding window with attention dropout has no fused TE kernel
    without flash-attn (bf16 `auto` keeps SDPA, an explicit te cannot take it packed), and gated
    DeltaNet layers name their kernels in the line the tool prints."""
    from megatron_kto.models import builder

    _state(monkeypatch, TE_2_9)
    arch = GPTArchitecture(
        sliding_window=8, attention_dropout=0.1, linear_attention_freq=[1, 0], vocab_size=128
    )
    choice = tool.choose_attention(_settings(_policy(tmp_path, "bf16", arch)))
    assert choice.backend == "sdpa" and "without attention dropout" in choice.reason
    assert "; gated DeltaNet: torch (" in choice.describe()
    layout = builder.ParallelLayout(precision="bf16", pack_sequences=True)
    assert builder.attention_choice(arch, layout) == choice
    (tmp_path / "te").mkdir()
    settings = _settings(_policy(tmp_path / "te", "bf16", arch), "--attention-backend", "te")
    with pytest.raises(tool.UsageError, match=r"^--attention-backend: 'te' cannot run bf16 \+"):
        tool.choose_attention(settings)


def test_impossible_explicit_backend_names_the_flags(monkeypatch, tmp_path):
    _state(monkeypatch, TE_2_9)
    settings = _settings(_policy(tmp_path, "32"), "--attention-backend", "te")
    with pytest.raises(tool.UsageError) as err:
        tool.choose_attention(settings)
    assert str(err.value) == (
        "--attention-backend: 'te' cannot run fp32 + packed sequences (Transformer Engine 2.9.0: "
        "its flash and fused attention need bf16 or fp16, its unfused attention takes packed "
        "(THD) input only from 2.11.0); set --attention-backend sdpa (or auto), or --precision bf16"
    )
    (tmp_path / "l").mkdir()
    settings = _settings(_policy(tmp_path / "l", "32"), "--attention-backend", "local")
    with pytest.raises(tool.UsageError, match=r"^--attention-backend: packed micro-batches"):
        tool.choose_attention(settings)


def test_run_hf_output_takes_the_runs_settings_and_its_own_tokenizer(tmp_path, monkeypatch):
    """A run's `hf/` (exp_manager.save_hf) has no config.yaml: β, data and reference come from
    the checkpoint its hf_export.json names, the tokenizer from the directory itself."""
    _state(monkeypatch, Accelerator(cuda=False))
    checkpoint = _policy(tmp_path, "bf16")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "tokenizer.json").write_text("{}")
    (hf / "hf_export.json").write_text(json.dumps({"step": 3, "checkpoint": str(checkpoint)}))
    s = _settings(hf)
    assert (s["beta"], s["precision"], s["reference"]) == (0.1, "bf16", str(checkpoint))
    assert s["data"] == [str(DATA.resolve())]
    assert (s["tokenizer"], s["tokenizer_library"]) == (str(hf.resolve()), "huggingface")
    # Without the record there is no run to read: --beta is asked for by name.
    (hf / "hf_export.json").unlink()
    with pytest.raises(tool.UsageError, match="--beta: required"):
        _settings(hf, "--reference", str(checkpoint), "--data", str(DATA))


def _dpo_policy(tmp_path: Path, loss_type: str) -> Path:
    policy = _policy(tmp_path, "32")
    text = (policy / "config.yaml").read_text()
    (policy / "config.yaml").write_text(
        text.replace(
            "model:\n",
            f"model:\n  dpo:\n    ref_policy_kl_penalty: 0.2\n    loss_type: {loss_type}\n",
        )  # fmt: skip
    )
    return policy


@pytest.mark.parametrize(
    "loss_type,flags,reference,average",
    [
        ("simpo", [], None, True),  # reference-free, per-token rewards (TRL's CPOTrainer)
        ("cpo", [], None, False),
        ("sigmoid", [], "policy", False),  # reference-based: the run's restore_from_path
        ("sigmoid", ["--reference", "none"], None, False),  # asked for
    ],
)
def test_reference_free_objectives_read_no_reference(
    tmp_path, loss_type, flags, reference, average
):
    policy = _dpo_policy(tmp_path, loss_type)
    got = _settings(policy, "--algorithm", "dpo", *flags)
    assert got["reference"] == (None if reference is None else str(policy))
    assert got["average_log_probs"] is average and got["beta"] == 0.2


def test_a_reference_for_a_reference_free_run_is_refused(tmp_path):
    policy = _dpo_policy(tmp_path, "orpo")
    with pytest.raises(
        tool.UsageError, match=r"^--reference: the run's model.dpo.loss_type \['orpo'\]"
    ):
        _settings(policy, "--algorithm", "dpo", "--reference", str(policy))
