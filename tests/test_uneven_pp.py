"""Uneven pipeline stages (`model.num_layers_in_first_pipeline_stage` / `_last_`): layer counts
PP does not divide (DeepSeek-V3's 61) train pipelined, with megatron-core's own layer offsets.

Tiny random `transformers` models, loaded straight from their Hugging Face directories: a Llama
of 3 layers (tied embeddings, shared between the stages), one of 6 and a DeepSeek-V3 of 5 layers
(MLA, a dense first layer, 4 sigmoid-routed experts). Shown here:

* log-probs at PP=2 with first=1 (Llama), PP=2 x VPP=2 with first=2 (the 6-layer Llama: chunks
  [0] [3] | [1, 2] [4, 5]), first=2 and last=1 (DeepSeek-V3) equal PP=1's and `transformers'`
  within 1e-5 relative; every chunk holds the layers megatron-core's offsets give it, and the
  memory plan's parameters of each chunk are the built chunk's, name by name;
* a 3-step KTO run of the DeepSeek-V3 from its Hugging Face directory at PP=2 (first=2) logs
  the PP=1 run's metrics and writes its hf/ weights (fp32 round-off); its step-2 checkpoint
  resumes at PP=1 (the even layout: distributed checkpoints are layout-free) to the same step 3;
* bad splits fail with one line naming the key.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import family_parity as fp
import pytest
import torch
from e2e_cli import KTO_SCRIPT, TOKENIZER, read_metrics, run_script
from family_parity import RELATIVE, VOCAB, reference_logprobs
from multirank import run_multirank
from test_e2e_moe import _args as moe_args

#: model -> {layout: (PP, VPP, first, last)}
LAYOUTS = {
    "llama": {"pp1": (1, None, None, None), "first1": (2, None, 1, None)},
    "llama6": {"pp1": (1, None, None, None), "vpp2_first2": (2, 2, 2, None)},
    "deepseek": {
        "pp1": (1, None, None, None),
        "first2": (2, None, 2, None),
        "last1": (2, None, None, 1),
    },
}
#: Per PP rank, its model chunks' layers (0-based), as megatron-core's offsets place them.
STAGES = {
    "first1": ([[0]], [[1, 2]]),
    "vpp2_first2": ([[0], [3]], [[1, 2], [4, 5]]),
    "first2": ([[0, 1]], [[2, 3, 4]]),
    "last1": ([[0, 1, 2, 3]], [[4]]),
}


def _deepseek_config(vocab: int):
    """hf_tiny's tiny DeepSeek-V3 with 5 layers (a dense first one), no query bottleneck and
    plain RoPE, small enough for the stage splits below."""
    from hf_tiny import tiny_sigmoid_routed_config

    return tiny_sigmoid_routed_config(
        "deepseek_v3",
        vocab,
        num_hidden_layers=5,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        v_head_dim=8,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def _save(directory: Path, config) -> torch.Tensor:
    """Save a random model of `config` (norms off 1, decisive routers, non-zero correction
    biases) and return its logits on the test rows."""
    from hf_tiny import save_sigmoid_routed
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    save_sigmoid_routed(model, directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(fp.tokens()).logits.float()


def _logprobs(arch, chunks) -> torch.Tensor | None:
    """The test rows' log-probs through megatron-core's schedule (two micro-batches of the same
    rows: the interleaved schedule needs PP of them); None off the last stage."""
    from megatron.core import parallel_state

    from megatron_kto.models.forward import eval_mode, gpt_forward_step
    from megatron_kto.models.logprobs import token_logprobs
    from megatron_kto.models.schedule import run_schedule

    tokens = fp.tokens()
    rows, length = tokens.shape
    batch = {
        "tokens": tokens,
        "labels": torch.cat([tokens[:, 1:], torch.full((rows, 1), -100)], dim=1),
        "position_ids": torch.arange(length).expand(rows, length).clone(),
    }
    step = gpt_forward_step(
        lambda b, logits: token_logprobs(logits, b["labels"], arch.vocab_size)[:, :-1]
    )
    with torch.no_grad(), eval_mode(chunks):
        out = run_schedule(
            chunks, [batch, batch], step, forward_only=True, collect_non_loss_data=True
        )
    return out[0] if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else None


def _worker(rank: int, world_size: int, root: str) -> dict:
    """Every model at every layout of `LAYOUTS`, straight from its HF directory: the last
    stage's log-probs, per model chunk its global layer numbers and (planned, built)
    parameters."""
    from megatron.core import parallel_state

    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks, unwrap
    from megatron_kto.planning.model_state import ParallelDims, chunk_parameters
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for name, layouts in LAYOUTS.items():
        path = Path(root) / name
        arch = read_architecture(path)
        for layout, (pp, vpp, first, last) in layouts.items():
            rt = init_runtime(1, pp, vpp, seed=9)  # PP=1: two data-parallel ranks
            split = ParallelLayout(
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp,
                num_layers_in_first_pipeline_stage=first,
                num_layers_in_last_pipeline_stage=last,
                attention_backend="sdpa",
            )
            chunks = build_gpt_chunks(arch, split, rt.device)
            restore_pretrained(path, chunks)
            stage = parallel_state.get_pipeline_model_parallel_rank()
            dims = ParallelDims(pp=pp, dp=2 // pp, vpp=vpp, first=first, last=last)
            built = [unwrap(chunk) for chunk in chunks]
            out[name, layout] = {
                "logprobs": _logprobs(arch, chunks),
                "layers": [[layer.layer_number - 1 for layer in c.decoder.layers] for c in built],
                "planned": [
                    [(p.name, p.numel) for p in chunk_parameters(arch, dims, stage, v)]
                    for v in range(len(built))
                ],
                "built": [[(n, p.numel()) for n, p in c.named_parameters()] for c in built],
            }
    teardown()
    return out


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """(HF logits per model, per rank the worker's results)."""
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("uneven")
    llama = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    logits = {
        "llama": _save(root / "llama", llama),
        "llama6": _save(
            root / "llama6", llama.__class__(**{**llama.to_dict(), "num_hidden_layers": 6})
        ),
        "deepseek": _save(root / "deepseek", _deepseek_config(VOCAB)),
    }
    return logits, run_multirank(_worker, 2, str(root), timeout=300)


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("llama", "first1"),
        ("llama6", "vpp2_first2"),
        ("deepseek", "first2"),
        ("deepseek", "last1"),
    ],
)
def test_uneven_stages_give_the_even_log_probs(stages, name, layout):
    """Each stage builds megatron-core's layers and the memory plan's parameters; the last
    stage's log-probs equal PP=1's and transformers'."""
    logits, ranks = stages
    for rank, layers in enumerate(STAGES[layout]):
        result = ranks[rank][name, layout]
        assert result["layers"] == layers
        assert result["planned"] == result["built"]
    got, even = ranks[1][name, layout]["logprobs"], ranks[0][name, "pp1"]["logprobs"]
    assert ranks[0][name, layout]["logprobs"] is None  # first stage: no head
    want = reference_logprobs(logits[name])
    for ours in (got, even):
        error = ((ours - want).abs() / want.abs().clamp(min=1.0)).max().item()
        print(f"{name} {layout}: max relative |Δ logp| vs transformers {error:.2e}")
        assert error <= RELATIVE
    assert (got - even).abs().max().item() <= RELATIVE * even.abs().max().item()


# ------------------------------------------------------------------------------ the CLI run
METRIC_RTOL, METRIC_ATOL, WEIGHT_ATOL = 1e-5, 5e-6, 1e-6
COMPARED = ("rewards/", "logps/", "loss", "kl", "grad_norm")
UNEVEN = ["model.pipeline_model_parallel_size=2", "model.num_layers_in_first_pipeline_stage=2"]
#: LoRA on every multi-latent attention projection of the tiny model (no query bottleneck),
#: adapters found by each layer's global number on the uneven stages.
LORA = [
    "model.peft.peft_scheme=lora",
    "model.peft.lora_tuning.adapter_dim=4",
    "model.peft.lora_tuning.alpha=16",
    "model.peft.lora_tuning.target_modules=[q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj]",
    "model.optim.lr=1e-3",
]


def _args(root: Path, log_dir: Path) -> list[str]:
    """test_e2e_moe's 3-step run (fp32, global batch 8 in micro-batches of 2) from `root / "hf"`,
    writing hf/ and keeping the step-2 checkpoint."""
    return [
        *moe_args(root, log_dir, "hf"),
        "exp_manager.save_hf=true",
        "trainer.kto.save_interval=2",
        "exp_manager.checkpoint_callback_params.save_top_k=-1",
    ]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """{name: (metrics, hf/ weights)}: PP=1 and PP=2 (first=2) for 3 steps from the Hugging
    Face directory; `resumed`: PP=1 from the PP=2 run's step-2 checkpoint to step 3; the same
    two layouts with LoRA on the attention (`lora_*`: hf/ is the PEFT adapter)."""
    from safetensors.torch import load_file

    from megatron_kto.data.tokenizers import load_tokenizer

    root = tmp_path_factory.mktemp("uneven_cli")
    vocab = load_tokenizer("sentencepiece", str(TOKENIZER)).vocab_size
    _save(root / "hf", _deepseek_config(vocab))
    run_script(KTO_SCRIPT, _args(root, root / "pp1"), timeout=600)
    run_script(KTO_SCRIPT, [*_args(root, root / "pp2"), *UNEVEN], nproc=2, timeout=600)
    resumed = root / "resumed" / "checkpoints"
    resumed.mkdir(parents=True)
    shutil.copytree(root / "pp2" / "checkpoints" / "step_2", resumed / "step_2")
    (resumed / "latest").write_text("step_2\n")
    run_script(KTO_SCRIPT, _args(root, root / "resumed"), timeout=600)
    run_script(KTO_SCRIPT, [*_args(root, root / "lora_pp1"), *LORA], timeout=600)
    run_script(KTO_SCRIPT, [*_args(root, root / "lora_pp2"), *LORA, *UNEVEN], nproc=2, timeout=600)
    return {
        name: (
            read_metrics(root / name),  # PP=2 writes a shard per stage
            {
                k: v
                for f in (root / name / "hf").glob("*.safetensors")
                for k, v in load_file(f).items()
            },
        )
        for name in ("pp1", "pp2", "resumed", "lora_pp1", "lora_pp2")
    }


def _same_rows(want: list[dict], got: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(want, got, strict=True):
        keys = [k for k in a if k.startswith(COMPARED)]
        assert "logps/chosen" in keys and "grad_norm" in keys
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=METRIC_RTOL, abs=METRIC_ATOL), (
                a["step"],
                key,
            )


@pytest.mark.e2e
def test_cli_run_at_uneven_pp2_equals_pp1(cli_runs):
    """Every logged metric of steps 1-3 and every hf/ weight (MoE experts, the dense first
    layer, MLA) of the PP=2 run equal the PP=1 run's."""
    want, reference = cli_runs["pp1"]
    got, weights = cli_runs["pp2"]
    assert len(want) == 3
    _same_rows(want, got)
    assert weights.keys() == reference.keys()
    assert (
        any(".mlp.experts." in k for k in weights)
        and "model.layers.0.mlp.up_proj.weight" in weights
    )
    for key in reference:
        assert (weights[key] - reference[key]).abs().max().item() <= WEIGHT_ATOL, key


@pytest.mark.e2e
def test_uneven_checkpoint_resumes_at_even_pp(cli_runs):
    """The PP=2 (first=2) run's step-2 checkpoint resumes at PP=1 to the PP=1 run's step 3."""
    want, reference = cli_runs["pp1"]
    got, weights = cli_runs["resumed"]
    _same_rows(want[2:], got)
    for key in reference:
        assert (weights[key] - reference[key]).abs().max().item() <= WEIGHT_ATOL, key


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["model.num_layers_in_first_pipeline_stage=2"], "needs pipeline_model_parallel_size > 1"),
        (
            [
                "model.pipeline_model_parallel_size=2",
                "model.num_layers_in_first_pipeline_stage=3",
                "model.num_layers_in_last_pipeline_stage=1",
            ],
            "left over with no middle stage",
        ),
        (
            ["model.pipeline_model_parallel_size=2"],
            "or set model.num_layers_in_first_pipeline_stage",
        ),
    ],
)
def test_bad_splits_are_refused_in_one_line(extra, message):
    """Config validation names the key (the tiny example with 5 layers, 2 ranks)."""
    from megatron_kto.config.validate import ConfigError, validate
    from megatron_kto.entry import compose_run_config

    with pytest.raises(ConfigError, match=message):
        prepared = compose_run_config(
            "gpt_kto", ["model.num_layers=5", *extra], "kto", world_size=2
        )
        validate(prepared.cfg, 2, "kto")


def test_planner_splits_61_layers_as_megatron_lm():
    """The layout planner's uneven split of DeepSeek-V3's 61 layers (PP16: 4 + 14 x 4 + 1, as
    Megatron-LM's recipe) and megatron-core's stages for it: every layer once, in order."""
    from megatron_kto.config.architecture import GPTArchitecture
    from megatron_kto.planning.layout import uneven_split
    from megatron_kto.planning.model_state import ParallelDims, chunk_layer_range

    assert [uneven_split(61, pp) for pp in (2, 4, 8, 16, 32)] == [
        (31, 30), (16, 13), (8, 5), (4, 1), None,
    ]  # fmt: skip
    dims = ParallelDims(pp=16, first=4, last=1)
    arch = GPTArchitecture(num_layers=61)
    stages = [chunk_layer_range(arch, dims, rank) for rank in range(16)]
    assert [len(s) for s in stages] == [4] * 15 + [1]
    assert [i for s in stages for i in s] == list(range(61))


@pytest.mark.e2e
def test_lora_at_uneven_pp2_equals_pp1(cli_runs):
    """LoRA on the MLA projections at PP=2 (first=2): every logged metric and every adapter
    tensor of hf/ (A and B of each adapted projection of all 5 layers) equal PP=1's, and the
    adapters moved well beyond the tolerance."""
    want, reference = cli_runs["lora_pp1"]
    got, adapters = cli_runs["lora_pp2"]
    _same_rows(want, got)
    assert adapters.keys() == reference.keys()
    assert {k.split(".layers.")[1].split(".")[0] for k in adapters} == {"0", "1", "2", "3", "4"}
    b = [k for k in reference if "lora_B" in k]
    assert len(b) == 5 * 4 and min(reference[k].abs().max().item() for k in b) > 1e-4
    for key in reference:
        assert (adapters[key] - reference[key]).abs().max().item() <= WEIGHT_ATOL, key
