"""A training run writes its model as a Hugging Face directory (`exp_manager.save_hf`).

Tiny `transformers` models made here (a Llama with grouped-query attention and untied
embeddings; a Qwen3-MoE with 4 experts; both with the ChatML tokenizer of `hf_tiny`) are
imported with `tools/convert_checkpoint.py` and trained 2 KTO steps by `examples/
train_gpt_kto.py` with `exp_manager.save_hf=true` under several layouts. The references are
independent of the in-training export: `tools/convert_checkpoint.py export` of the same run's
final checkpoint (one process, TP=1, loaded through dist_checkpointing), and our own megatron
model rebuilt from that checkpoint at TP=1.

* TP=1, TP=2 (every save, small shards: an index), PP=2 x VPP=2 (a chat template override),
  Qwen3-MoE at EP=2 (DP=2) and at TP=2 x EP=2 x ETP=1 (DP=1): `hf/` holds the same tensors as the tool's export, bit for bit, and the same config.json;
* `AutoModelForCausalLM.from_pretrained(run/hf)` gives the trained policy's per-token log-probs
  (our TP=1 model from the checkpoint) to 1e-5, and they differ from the starting model's;
* `AutoTokenizer.from_pretrained(run/hf)` has the run's chat template (the override where given);
* LoRA at TP=2 and at PP=2 (TP=1 beside other ranks): `hf/` is a PEFT adapter directory whose tensors equal the tool's adapter export;
  `peft.PeftModel.from_pretrained(<the HF base>, run/hf)` gives our LoRA model's log-probs, and
  `hf_merged/` equals the tool's `--merge-lora` export.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from e2e_cli import KTO_SCRIPT, QUIET, REPO, run_script
from hf_tiny import (
    CHATML,
    make_hf_chat_model,
    make_tokenizer,
    tiny_qwen3_moe_config,
    write_kto_rows,
)
from multirank import run_multirank

pytestmark = pytest.mark.e2e

TOOL = REPO / "tools" / "convert_checkpoint.py"
TOLERANCE = 1e-5
OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
LORA = [
    "model.peft.peft_scheme=lora",
    "model.peft.lora_tuning.adapter_dim=4",
    "model.peft.lora_tuning.alpha=16",
    "model.peft.lora_tuning.target_modules=[q_proj,k_proj,v_proj,o_proj,mlp]",
    "exp_manager.save_hf_merged=true",
]
LORA_RUNS = ("lora_tp2", "lora_pp2")
#: name -> (base model, ranks, overrides)
RUNS = {
    "tp1": ("dense", 1, []),
    "tp2": (
        "dense",
        2,
        [
            "model.tensor_model_parallel_size=2",
            "exp_manager.save_hf_every_save=true",
            "trainer.kto.save_interval=1",
            "exp_manager.save_hf_max_shard_mb=0.05",
        ],
    ),
    "pp2": (
        "dense",
        2,
        ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"],
    ),
    "lora_tp2": ("dense", 2, ["model.tensor_model_parallel_size=2", *LORA]),
    "lora_pp2": ("dense", 2, ["model.pipeline_model_parallel_size=2", *LORA]),
    "moe_ep2": ("moe", 2, ["model.expert_model_parallel_size=2", "model.micro_batch_size=2"]),
    # EP across the two TP ranks, whole experts on each (ETP=1): experts gathered over EP only.
    "moe_tp2ep2etp1": (
        "moe",
        2,
        [
            "model.tensor_model_parallel_size=2",
            "model.sequence_parallel=true",
            "model.expert_model_parallel_size=2",
            "model.expert_tensor_parallel_size=1",
        ],
    ),
}


def _make_moe(directory: Path) -> None:
    from transformers import AutoModelForCausalLM

    vocab = make_tokenizer(directory)
    torch.manual_seed(0)
    config = tiny_qwen3_moe_config(vocab, bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def _train(root: Path, name: str) -> str:
    base, nproc, extra = RUNS[name]
    if name == "pp2":
        (root / "template.jinja").write_text(OTHER_TEMPLATE)
        extra = [*extra, f"model.tokenizer.chat_template={root / 'template.jinja'}"]
    proc = run_script(
        KTO_SCRIPT,
        [
            *QUIET,
            f"pretrained_checkpoint.restore_from_path={root / f'{base}_mcore'}",
            f"model.data.data_prefix.train=[{root / 'train.jsonl'}]",
            "model.data.data_prefix.validation=[]",
            "trainer.precision=32",
            f"exp_manager.explicit_log_dir={root / name}",
            "trainer.kto.max_steps=2",
            "model.global_batch_size=8",
            "model.micro_batch_size=4",
            "model.optim.lr=1e-2",
            "model.optim.sched.name=Constant",
            "model.optim.sched.warmup_steps=0",
            "exp_manager.save_hf=true",
            *extra,
        ],
        nproc=nproc,
        timeout=600,
    )
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_output")
    make_hf_chat_model(root / "dense_hf", kv_heads=2, tie=False)
    _make_moe(root / "moe_hf")
    write_kto_rows(root / "train.jsonl", 0, 64)
    for base in ("dense", "moe"):
        args = [
            "import",
            "--hf-dir",
            str(root / f"{base}_hf"),
            "--out",
            str(root / f"{base}_mcore"),
        ]
        run_script(TOOL, args)
    logs = {name: _train(root, name) for name in RUNS}
    for name in RUNS:
        run_script(
            TOOL, ["export", "--ckpt", str(root / name), "--out", str(root / f"{name}_tool")]
        )
    for name in LORA_RUNS:
        merge = ["--out", str(root / f"{name}_tool_merged"), "--merge-lora"]
        run_script(TOOL, ["export", "--ckpt", str(root / name), *merge])
    ours = run_multirank(_ours_worker, 1, [str(root / n) for n in RUNS], timeout=300)[0]
    return root, logs, dict(zip(RUNS, ours, strict=True))


def _tokens() -> torch.Tensor:
    return torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(3))


def _logps(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs of `tokens[:, 1:]` (float64)."""
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _ours_worker(rank: int, world_size: int, run_dirs: list[str]) -> list[torch.Tensor]:
    """Our trained policy (TP=1, rebuilt from each run's final checkpoint): per-token log-probs."""
    from megatron_kto.checkpointing.locate import resolve_pretrained_dir
    from megatron_kto.checkpointing.model_io import load_model, read_architecture
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
    from megatron_kto.peft.checkpoint import build_lora_model, is_lora_checkpoint
    from megatron_kto.runtime import init_runtime, teardown

    rt = init_runtime(1, 1, seed=0)
    tokens = _tokens()
    out = []
    for run_dir in run_dirs:
        ckpt = resolve_pretrained_dir(run_dir)
        arch = read_architecture(ckpt)
        chunks = build_gpt_chunks(arch, ParallelLayout(), rt.device)
        if is_lora_checkpoint(ckpt):
            build_lora_model(ckpt, chunks, arch)
        else:
            load_model(ckpt, chunks)
        model = unwrap(chunks[0]).eval()
        with torch.no_grad():
            logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
        out.append(_logps(logits[..., : arch.vocab_size], tokens))
    teardown()
    return out


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from megatron_kto.conversion.safetensors_io import HFWeights

    weights = HFWeights(directory)
    return {name: weights.get(name) for name in weights.names()}


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not different, different[:4]


def _hf_logps(directory: Path, adapter: Path | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return _logps(model.eval()(_tokens()).logits, _tokens())


FULL = ("tp1", "tp2", "pp2", "moe_ep2", "moe_tp2ep2etp1")


@pytest.mark.parametrize("name", FULL)
def test_hf_dir_equals_the_tool_export_and_gives_the_policy_logps(runs, name):
    root, _, ours = runs
    out, tool = root / name / "hf", root / f"{name}_tool"
    _assert_same_tensors(_tensors(out), _tensors(tool))
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (tool / "config.json").read_text()
    )
    record = json.loads((out / "hf_export.json").read_text())
    assert record["step"] == 2 and record["format"] == "full"
    assert not list(root.glob(f"{name}/hf.*")), "a temporary or old directory was left behind"
    base = "moe" if name.startswith("moe") else "dense"
    got, start = _hf_logps(out), _hf_logps(root / f"{base}_hf")
    diff = (got - ours[name]).abs().max().item()
    moved = (got - start).abs().max().item()
    print(f"\n{name}: transformers vs ours {diff:.2e}; trained vs start {moved:.3f}")
    assert diff <= TOLERANCE
    assert moved > 1e-2


def test_every_save_and_sharding(runs):
    root, logs, _ = runs
    assert "wrote the Hugging Face output of step 1" in logs["tp2"]
    assert "wrote the Hugging Face output of step 2" in logs["tp2"]
    index = json.loads((root / "tp2" / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((root / "tp2" / "hf" / f).is_file() for f in files)
    assert "wrote the Hugging Face output of step 1" not in logs["tp1"]


@pytest.mark.parametrize("name,template", [("tp1", CHATML), ("pp2", OTHER_TEMPLATE)])
def test_tokenizer_and_chat_template(runs, name, template):
    from transformers import AutoTokenizer

    root, _, _ = runs
    ours = AutoTokenizer.from_pretrained(root / name / "hf")
    source = AutoTokenizer.from_pretrained(root / "dense_hf")
    assert ours.chat_template == template
    text = "a short prompt and its answer"
    assert ours(text)["input_ids"] == source(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) != ""
    generation = json.loads((root / name / "hf" / "generation_config.json").read_text())
    assert generation == json.loads((root / "dense_hf" / "generation_config.json").read_text())


@pytest.mark.parametrize("name", LORA_RUNS)
def test_lora_adapter_dir_loads_in_peft_with_the_policy_logps(runs, name):
    from safetensors.torch import load_file

    root, _, ours = runs
    out, tool = root / name / "hf", root / f"{name}_tool"
    mine = load_file(str(out / "adapter_model.safetensors"))
    _assert_same_tensors(mine, load_file(str(tool / "adapter_model.safetensors")))
    assert json.loads((out / "adapter_config.json").read_text()) == json.loads(
        (tool / "adapter_config.json").read_text()
    )
    got = _hf_logps(root / "dense_hf", adapter=out)
    start = _hf_logps(root / "dense_hf")
    diff = (got - ours[name]).abs().max().item()
    print(f"\n{name}: peft vs ours {diff:.2e}; adapted vs base {(got - start).abs().max():.3f}")
    assert diff <= TOLERANCE
    assert (got - start).abs().max().item() > 1e-2


@pytest.mark.parametrize("name", LORA_RUNS)
def test_lora_merged_dir_equals_the_tool_merge(runs, name):
    root, _, ours = runs
    merged, tool = root / name / "hf_merged", root / f"{name}_tool_merged"
    a, b = _tensors(merged), _tensors(tool)
    # The same full tensors through the same merge formula: bit for bit.
    _assert_same_tensors(a, b)
    diff = (_hf_logps(merged) - ours[name]).abs().max().item()
    assert diff <= TOLERANCE
