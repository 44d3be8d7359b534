"""The checkpoint's architecture is the model: resolution before anything is built.

With `pretrained_checkpoint.restore_from_path` the shape comes from the checkpoint's
architecture.json; what the config states (a preset, an override) must agree with it, and the
layout checks (TP vs heads / query groups, PP vs layers, max_length vs the position limit, the
tokenizer vs the vocabulary) run against it — as file reads only, no megatron-core. The
checkpoints here are the files `restore_from_path` resolution looks at (architecture.json and
the dist-checkpoint metadata marker, plus tokenizer files or a run config where a test needs
them); no tensors are involved.

A LoRA run starting from a PEFT adapter (written by `peft` itself) takes its rank, alpha and
targets from the adapter's adapter_config.json, refusing stated values that differ in one line
naming them all; the adapter given as the model is told where it goes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hf_tiny import make_peft_adapter, make_tokenizer

from megatron_kto.checkpointing import files
from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.config.validate import ConfigError
from megatron_kto.entry import compose_run_config
from megatron_kto.prepare import prepare_run_config

REPO = Path(__file__).resolve().parents[1]
SP = str(REPO / "examples" / "data" / "tokenizer" / "tiny_sp.model")
TRAIN = str(REPO / "examples" / "data" / "tiny_kto" / "train.jsonl")
#: A SmolLM-135M-like shape, shrunk: 9 heads over 3 key/value groups, 6 layers.
SHAPE = dict(
    num_layers=6, hidden_size=72, ffn_hidden_size=192, num_attention_heads=9,
    num_query_groups=3, encoder_seq_length=256, vocab_size=320, padded_vocab_size=384,
    share_embeddings_and_output_weights=True, rotary_base=100000,
)  # fmt: skip


def _checkpoint(path: Path, tokenizer: str | None = "hf", **changes) -> Path:
    """A directory `restore_from_path` accepts: architecture.json + the dist-checkpoint marker."""
    path.mkdir(parents=True)
    arch = GPTArchitecture(**{**SHAPE, **changes})
    (path / "architecture.json").write_text(json.dumps(arch.to_dict()))
    (path / "metadata.json").write_text("{}")
    if tokenizer == "hf":
        make_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("ckpt") / "converted")


def _run(ckpt: Path, *overrides: str, world: int = 1):
    return compose_run_config(
        "gpt_kto",
        [f"pretrained_checkpoint.restore_from_path={ckpt}", f"model.data.data_prefix.train=[{TRAIN}]",
         *overrides],
        world_size=world,
    )  # fmt: skip


def test_architecture_and_tokenizer_come_from_the_checkpoint(ckpt):
    prepared = _run(ckpt)
    m = prepared.cfg.model
    assert prepared.architecture_file == str(ckpt / "architecture.json")
    assert (m.num_layers, m.num_attention_heads, m.num_query_groups) == (6, 9, 3)
    assert (m.vocab_size, m.padded_vocab_size, m.encoder_seq_length) == (320, 384, 256)
    assert (m.tokenizer.library, m.tokenizer.model) == ("huggingface", str(ckpt))
    assert prepared.architecture == GPTArchitecture(**SHAPE)


def test_tp_that_does_not_divide_the_checkpoint_heads_names_the_layout_key(ckpt):
    """The tiny preset (4 heads, 2 groups) would accept TP=2; the 9-head checkpoint does not."""
    with pytest.raises(ConfigError) as info:
        _run(ckpt, "model.tensor_model_parallel_size=2", world=2)
    assert str(info.value) == (
        f"model.tensor_model_parallel_size: 2 does not divide the 9 attention heads in "
        f"{ckpt / 'architecture.json'}"
    )
    _run(ckpt, "model.tensor_model_parallel_size=3", world=3)  # 9 heads, 3 groups: fine


def test_groups_and_layers_are_checked_against_the_checkpoint(tmp_path):
    ckpt = _checkpoint(tmp_path / "c", num_attention_heads=6, num_query_groups=3, hidden_size=48)
    with pytest.raises(
        ConfigError,
        match=r"^model.tensor_model_parallel_size: 2 does not divide the 3 query groups in ",
    ):
        _run(ckpt, "model.tensor_model_parallel_size=2", world=2)
    with pytest.raises(
        ConfigError,
        match=r"^model.pipeline_model_parallel_size: 4 does not divide the 6 layers in ",
    ):
        _run(ckpt, "model.pipeline_model_parallel_size=4", world=4)
    with pytest.raises(
        ConfigError,
        match=r"^model.virtual_pipeline_model_parallel_size: PP x VPP = 2 x 2 does not divide the 6 layers",
    ):
        _run(ckpt, "model.pipeline_model_parallel_size=2",
             "model.virtual_pipeline_model_parallel_size=2", world=2)  # fmt: skip


def test_tp_must_split_the_checkpoint_embedding_rows(tmp_path):
    """A converted checkpoint fixes its embedding rows; TP must divide them (else a ValueError
    from deep inside the model build)."""
    ckpt = _checkpoint(tmp_path / "c", num_attention_heads=6, num_query_groups=6, hidden_size=48,
                       padded_vocab_size=328)  # fmt: skip
    with pytest.raises(ConfigError) as info:
        _run(ckpt, "model.tensor_model_parallel_size=3", world=3)
    assert str(info.value) == (
        "model.tensor_model_parallel_size: 3 does not divide the 328 embedding rows "
        f"(padded_vocab_size) in {ckpt / 'architecture.json'}"
    )


def test_max_length_is_checked_against_the_checkpoint_position_limit(ckpt):
    with pytest.raises(ConfigError) as info:
        _run(ckpt, "model.data.max_length=512")
    assert str(info.value) == (
        f"model.data.max_length: 512 exceeds the position limit 256 in {ckpt / 'architecture.json'}"
    )


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["model=llama3_2_1b"], "model.num_layers: 16 from model=llama3_2_1b contradicts 6 in "),
        (["model.num_attention_heads=8"], "model.num_attention_heads: 8 (command line) contradicts 9 in "),
        (["example=tiny_kto"], "model.num_layers: 2 from example=tiny_kto (model=tiny) contradicts 6 in "),
    ],
)  # fmt: skip
def test_a_stated_shape_that_contradicts_the_checkpoint_is_one_line(ckpt, overrides, expected):
    with pytest.raises(ConfigError) as info:
        _run(ckpt, *overrides)
    message = str(info.value)
    assert message.startswith(expected), message
    assert str(ckpt / "architecture.json") in message and "\n" not in message


def test_agreeing_values_and_training_choices_are_accepted(ckpt):
    """Restating the checkpoint's values is fine; dropout is the run's choice; init_method_std
    means nothing for loaded weights."""
    prepared = _run(ckpt, "model.num_layers=6", "model.rotary_base=100000", "model.layernorm_epsilon=0.00001",
                    "model.hidden_dropout=0.1", "model.init_method_std=0.5")  # fmt: skip
    assert prepared.architecture.hidden_dropout == 0.1
    assert prepared.architecture.init_method_std == GPTArchitecture().init_method_std


def test_tokenizer_larger_than_the_model_vocabulary(tmp_path):
    ckpt = _checkpoint(tmp_path / "c", vocab_size=100, padded_vocab_size=128)
    with pytest.raises(ConfigError) as info:
        _run(ckpt)
    assert str(info.value) == (
        f"model.tokenizer.model: {ckpt} has 320 tokens, more than the model's vocabulary of 100 "
        f"({ckpt / 'architecture.json'})"
    )


def test_tokenizer_must_exist_somewhere(tmp_path):
    ckpt = _checkpoint(tmp_path / "c", tokenizer=None, vocab_size=384)
    with pytest.raises(
        ConfigError,
        match=r"holds no tokenizer \(tokenizer.json or tokenizer.model\); set model.tokenizer.model$",
    ):
        _run(ckpt)
    prepared = _run(ckpt, f"model.tokenizer.model={SP}")  # the bundled 384-token model
    assert prepared.cfg.model.tokenizer.library == "sentencepiece"


def test_training_checkpoint_brings_its_run_tokenizer(tmp_path):
    """A previous run's step_<N> (or its run directory) names the tokenizer in config.yaml."""
    step = _checkpoint(tmp_path / "run" / "checkpoints" / "step_4", tokenizer=None, vocab_size=384)
    (step / files.CONFIG).write_text(
        f"model:\n  tokenizer:\n    library: sentencepiece\n    model: {SP}\n"
    )
    for name in files.REQUIRED:
        if not (step / name).exists():
            (step / name).write_text("{}")
    files.write_manifest(step)
    files.write_latest(step.parent, "step_4")
    prepared = _run(tmp_path / "run")
    assert prepared.checkpoint_dir == step
    assert (prepared.cfg.model.tokenizer.library, prepared.cfg.model.tokenizer.model) == (
        "sentencepiece", SP,
    )  # fmt: skip


def test_missing_checkpoint_is_one_line(tmp_path):
    from megatron_kto.checkpointing.errors import CheckpointError

    with pytest.raises(
        CheckpointError, match=r"not found \(pretrained_checkpoint.restore_from_path\)$"
    ):
        _run(tmp_path / "nope")


def test_validation_imports_no_megatron_core(ckpt):
    """The whole resolution runs before megatron-core is imported (so errors come in seconds)."""
    code = (
        "import sys\n"
        "from megatron_kto.entry import compose_run_config\n"
        f"compose_run_config('gpt_kto', ['pretrained_checkpoint.restore_from_path={ckpt}', "
        f"'model.data.data_prefix.train=[{TRAIN}]'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_lora_settings_come_from_the_starting_adapter(ckpt, tmp_path):
    adapter = make_peft_adapter(
        tmp_path / "adapter", 6, r=4, lora_alpha=8, target_modules=r".*\.(q_proj|o_proj)"
    )
    lora = ["model.peft.peft_scheme=lora", f"model.peft.restore_from_path={adapter}"]
    prepared = _run(ckpt, *lora)
    lt = prepared.cfg.model.peft.lora_tuning
    assert (lt.adapter_dim, lt.alpha, list(lt.target_modules), lt.layer_selection) == (
        4, 8.0, ["o_proj", "q_proj"], None,
    )  # fmt: skip
    # The run prepares its (already resolved) config again: the written-back values agree.
    again = prepare_run_config(prepared.cfg, "kto", world_size=1).cfg.model.peft.lora_tuning
    assert again == lt
    # The same targets as peft's string form on the command line (Hydra's quoting) agree.
    regex = "model.peft.lora_tuning.target_modules='.*\\.(o_proj|q_proj)'"
    assert list(_run(ckpt, *lora, regex).cfg.model.peft.lora_tuning.target_modules) == [
        "o_proj", "q_proj",
    ]  # fmt: skip
    stated = [
        "model.peft.lora_tuning.adapter_dim=16",
        "model.peft.lora_tuning.alpha=8",  # agrees
        "model.peft.lora_tuning.target_modules=[attention_qkv]",
        "model.peft.lora_tuning.layer_selection=[1]",
    ]
    with pytest.raises(ConfigError) as info:
        _run(ckpt, *lora, *stated)
    text = str(info.value)
    assert "\n" not in text and text.startswith(
        "model.peft.lora_tuning.adapter_dim=16, "
        "model.peft.lora_tuning.target_modules=['attention_qkv'], "
        "model.peft.lora_tuning.layer_selection=[1]: the starting adapter "
        f"model.peft.restore_from_path={adapter} has adapter_dim=4, "
        "target_modules=['o_proj', 'q_proj'], layer_selection=None; "
    ), text


def test_an_adapter_given_as_the_model_is_told_where_it_goes(tmp_path):
    from megatron_kto.checkpointing.errors import CheckpointError

    adapter = make_peft_adapter(tmp_path / "adapter", 2, target_modules=["q_proj"])
    with pytest.raises(CheckpointError) as info:
        _run(adapter)
    text = str(info.value)
    assert text == (
        f"{adapter}: a PEFT adapter directory (adapter_config.json), not a model: pass it as "
        "model.peft.restore_from_path (with model.peft.peft_scheme=lora) and its base model as "
        "pretrained_checkpoint.restore_from_path"
    )
