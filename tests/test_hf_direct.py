"""`pretrained_checkpoint.restore_from_path=<Hugging Face dir>`: each rank reads its own slices.

The reference is the path users had before: `convert.import_hf` (the converter behind
`tools/convert_checkpoint.py import`) writes a megatron checkpoint, and megatron-core's
`dist_checkpointing` reshards it on restore. Loading the Hugging Face directory directly must give
every parameter of every rank bit for bit the same value, at TP=1, TP=2, PP=2, (MoE) EP=2 and, for
one model, PP=2 with two interleaved chunks per stage, for tiny random `transformers` models of
five families: Llama (GQA, untied, its weights sharded over
several safetensors files with an index), Qwen2 (q/k/v biases, bf16 weights as on the Hub; also
into a bf16 model) Qwen3-MoE (tied embeddings, so the last pipeline stage's output layer comes
from the embedding), Mixtral, and Qwen2-MoE (a gated shared expert, sharded over TP like a dense
MLP); and Qwen3-MoE / Qwen2-MoE with dense layers between MoE layers (`mlp_only_layers`,
`decoder_sparse_step`).

Memory: what a rank reads is counted from the slices it copies out of the files
(`LoadStats.bytes_read`), and compared with sums over the files' own tensor sizes: at TP=2 the two
ranks together read the model once plus the replicated tensors (norms, routers) twice, and each
about half; at PP=2 each stage reads exactly its layers' tensors (plus the embedding on the first
stage, the final norm and output weights on the last).

Bad input is one line naming the file: no config.json, an unsupported model type (naming the
supported ones), a missing tensor (naming it and the file), a tensor of the wrong shape.

Spawns: one single-process worker (imports, TP=1, bad input) and one 2-rank worker (TP=2, PP=2,
EP=2, VPP, and expert TP apart from TP: TP=2 x ETP=1, TP=1 x ETP=2).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from multirank import run_multirank

VOCAB = 2000  # padded to 2048 rows: at TP=2 each rank's embedding rows are mostly real
MODELS = ("llama", "qwen2", "qwen3_moe", "mixtral", "qwen2_moe", "qwen3_mixed", "qwen2_mixed")
MOE = ("qwen3_moe", "mixtral", "qwen2_moe", "qwen3_mixed", "qwen2_mixed")
#: layout -> (TP, PP, EP, VPP) on 2 ranks
LAYOUTS = {"tp2": (2, 1, 1, None), "pp2": (1, 2, 1, None), "ep2": (1, 1, 2, None)}
#: Interleaved pipeline (two chunks per stage), for one model.
VPP = {"pp2_vpp2": (1, 2, 1, 2)}
#: Expert tensor parallelism apart from TP, for the MoE models: layout -> (TP, ETP) on 2 ranks.
#: TP=2 with whole experts on each rank; TP=1 with every expert split over both (DP) ranks.
ETP = {"tp2etp1": (2, 1), "etp2": (1, 2)}


def _hf_configs() -> dict[str, object]:
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    return {
        "llama": LlamaConfig(intermediate_size=96, tie_word_embeddings=False, **common),
        "qwen2": Qwen2Config(intermediate_size=96, tie_word_embeddings=False, **common),
        "qwen3_moe": Qwen3MoeConfig(
            intermediate_size=96,
            moe_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=32,
            tie_word_embeddings=True,
            **common,
        ),
        "mixtral": MixtralConfig(
            intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common
        ),
        "qwen2_moe": Qwen2MoeConfig(
            intermediate_size=96,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            **common,
        ),
        # Dense layers between MoE layers: layers 1 and 2 (one per pipeline stage at PP=2) ...
        "qwen3_mixed": Qwen3MoeConfig(
            intermediate_size=80,
            moe_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=32,
            mlp_only_layers=[1, 2],
            tie_word_embeddings=False,
            **common,
        ),
        # ... and every second layer MoE, with a shared expert (layers 0 and 2 dense).
        "qwen2_mixed": Qwen2MoeConfig(
            intermediate_size=80,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            **common,
        ),
    }


def _state(chunks) -> dict[str, torch.Tensor]:
    from megatron_kto.models.builder import unwrap

    out = {}
    for i, chunk in enumerate(chunks):
        for name, p in unwrap(chunk).named_parameters():
            out[f"{i}.{name}"] = p.detach().clone()
    return out


def _both_ways(
    root: Path, name: str, layout: tuple, rt, precision: str = "32", etp: int | None = None
) -> dict:
    """This rank's parameters restored from the converted checkpoint and from the HF directory."""
    from megatron_kto.checkpointing.hf_source import load_hf_model
    from megatron_kto.checkpointing.locate import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks

    tp, pp, ep, vpp = layout
    par = ParallelLayout(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        virtual_pipeline_model_parallel_size=vpp,
        precision=precision,
        expert_tensor_parallel_size=etp,
    )
    hf_arch = read_architecture(root / name / "hf")
    assert hf_arch == read_architecture(root / name / "mcore")
    converted = build_gpt_chunks(hf_arch, par, rt.device)
    restore_pretrained(root / name / "mcore", converted)
    direct = build_gpt_chunks(hf_arch, par, rt.device)
    with torch.no_grad():
        for chunk in direct:  # anything left unfilled stays NaN and fails the comparison
            for p in chunk.parameters():
                p.fill_(float("nan"))
    stats = load_hf_model(root / name / "hf", direct)
    want, got = _state(converted), _state(direct)
    assert want.keys() == got.keys()
    unequal = [k for k in want if not torch.equal(want[k], got[k])]
    # The local shapes of an expert's and the attention's row-parallel weight (the first layer
    # that has one: a mixed model's layer 0 may be dense): the expert's input dimension is split
    # by ETP, the attention's by TP.
    shapes = {
        kind: tuple(next(v.shape for k, v in sorted(got.items()) if k.endswith(suffix)))
        for kind, suffix in (
            ("expert", "mlp.experts.local_experts.0.linear_fc2.weight"),
            ("attention", "self_attention.linear_proj.weight"),
        )
        if any(k.endswith(suffix) for k in got)
    }
    return {"unequal": unequal, "count": len(want), "bytes": stats.bytes_read, "shapes": shapes}


def _errors(root: Path, rt) -> dict[str, str]:
    """The one-line messages for bad input (directories derived from the Qwen2 model)."""
    from safetensors.torch import load_file, save_file

    from megatron_kto.checkpointing.errors import CheckpointError
    from megatron_kto.checkpointing.hf_source import load_hf_model
    from megatron_kto.checkpointing.locate import read_architecture, resolve_pretrained_dir
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks

    source = root / "qwen2" / "hf"
    bad = root / "bad"
    out = {}

    def fresh(tag: str) -> Path:
        target = bad / tag
        shutil.copytree(source, target)
        return target

    def message(fn) -> str:
        try:
            fn()
        except CheckpointError as e:
            return str(e)
        return "no error"

    no_config = fresh("no_config")
    (no_config / "config.json").unlink()
    out["no_config"] = message(lambda: resolve_pretrained_dir(no_config))
    gpt2 = fresh("gpt2")
    config = json.loads((gpt2 / "config.json").read_text()) | {"model_type": "gpt2"}
    (gpt2 / "config.json").write_text(json.dumps(config))
    out["model_type"] = message(lambda: read_architecture(gpt2))
    arch = read_architecture(source)
    for tag, edit in (
        ("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        ("shape", lambda t: t.update({"model.norm.weight": torch.ones(65)})),
    ):
        target = fresh(tag)
        tensors = load_file(target / "model.safetensors")
        edit(tensors)
        save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
        chunks = build_gpt_chunks(arch, ParallelLayout(), rt.device)
        out[tag] = message(lambda t=target, c=chunks: load_hf_model(t, c))
    return out


def _single_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_kto.hf_writer.convert import import_hf
    from megatron_kto.runtime import init_runtime, teardown

    root = Path(root)
    out = {}
    for name in MODELS:
        import_hf(root / name / "hf", root / name / "mcore")
    rt = init_runtime(1, 1, seed=9)
    for name in MODELS:
        out["tp1", name] = _both_ways(root, name, (1, 1, 1, None), rt)
    out["tp1_bf16", "qwen2"] = _both_ways(root, "qwen2", (1, 1, 1, None), rt, precision="bf16")
    out["errors"] = _errors(root, rt)
    teardown()
    return out


def _layout_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for layout, (tp, pp, ep, vpp) in (LAYOUTS | VPP).items():
        rt = init_runtime(tp, pp, vpp, seed=9, expert_parallel_size=ep)
        for name in MOE if ep > 1 else ("qwen3_moe",) if vpp else MODELS:
            out[layout, name] = _both_ways(Path(root), name, (tp, pp, ep, vpp), rt)
    for layout, (tp, etp) in ETP.items():
        rt = init_runtime(tp, 1, seed=9, expert_tensor_parallel_size=etp)
        for name in MOE:
            out[layout, name] = _both_ways(Path(root), name, (tp, 1, 1, None), rt, etp=etp)
    teardown()
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf_direct")
    for name, config in _hf_configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname or pname.endswith("bias"):  # away from 1 / 0
                    p.add_(0.1 * torch.randn_like(p))
        if name == "qwen2":  # as most Hub models: bf16 weights
            model = model.to(torch.bfloat16)
        # Llama as the Hub publishes large models: several shards and an index.
        shard = "200KB" if name == "llama" else "5GB"
        model.save_pretrained(root / name / "hf", max_shard_size=shard)
    single = run_multirank(_single_worker, 1, str(root), timeout=600)[0]
    ranks = run_multirank(_layout_worker, 2, str(root), timeout=600)
    return root, single, ranks


def test_llama_input_is_sharded(loaded):
    root = loaded[0]
    files = sorted(p.name for p in (root / "llama" / "hf").glob("*.safetensors"))
    assert len(files) > 2 and (root / "llama" / "hf" / "model.safetensors.index.json").is_file()


CASES = (
    [("tp1", n) for n in MODELS]
    + [("tp1_bf16", "qwen2")]
    + [(lay, n) for lay in LAYOUTS for n in MODELS if lay != "ep2" or n in MOE]
    + [("pp2_vpp2", "qwen3_moe")]
    + [(lay, n) for lay in ETP for n in MOE]
)


@pytest.mark.parametrize("layout,name", CASES, ids=[f"{n}-{lay}" for lay, n in CASES])
def test_direct_load_equals_import_then_restore(loaded, layout, name):
    _, single, ranks = loaded
    one = layout.startswith("tp1")
    results = [single[layout, name]] if one else [r[layout, name] for r in ranks]
    for rank, result in enumerate(results):
        assert result["count"] > 0
        assert result["unequal"] == [], f"rank {rank}: {result['unequal'][:4]}"


@pytest.mark.parametrize("layout", list(ETP))
def test_expert_tensor_parallelism_splits_the_experts_not_the_attention(loaded, layout):
    """The layouts above really are ETP != TP: an expert's fc2 input (moe_intermediate_size 48)
    is split ETP ways, the attention output projection's input (heads x head dim) TP ways."""
    tp, etp = ETP[layout]
    for rank in loaded[2]:
        for name in MOE:
            shapes = rank[layout, name]["shapes"]
            assert shapes["expert"] == (64, 48 // etp), (name, shapes)
            width = 4 * (32 if name.startswith("qwen3") else 64 // 4)  # heads x head dim
            assert shapes["attention"] == (64, width // tp), (name, shapes)


def _hf_sizes(model_dir: Path) -> dict[str, int]:
    """Bytes of each tensor in the directory's files, from the safetensors headers."""
    from safetensors import safe_open

    sizes = {}
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                lazy = f.get_slice(key)
                itemsize = torch.empty(
                    (), dtype=getattr(torch, _DTYPES[lazy.get_dtype()])
                ).element_size()
                sizes[key] = math.prod(lazy.get_shape()) * itemsize
    return sizes


_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@pytest.mark.parametrize("name", MODELS)
def test_tp2_rank_reads_about_half(loaded, name):
    root, _, ranks = loaded
    sizes = _hf_sizes(root / name / "hf")
    total = sum(sizes.values())
    assert loaded[1]["tp1", name]["bytes"] == total  # TP=1 reads every tensor once
    # Replicated over TP: norms (RMSNorm weights, incl. Q/K norms), MoE routers (`mlp.gate`,
    # Mixtral's `block_sparse_moe.gate`) and Qwen2-MoE's shared-expert gate.
    routers = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")
    replicated = sum(v for k, v in sizes.items() if "norm" in k or k.endswith(routers))
    read = [r["tp2", name]["bytes"] for r in ranks]
    assert sum(read) == total + replicated
    for rank_bytes in read:
        assert rank_bytes <= 0.55 * total, (rank_bytes, total)
    print(f"{name}: model {total} B, TP=2 ranks read {read} B")


@pytest.mark.parametrize("name", MODELS)
def test_pp2_stage_reads_its_layers(loaded, name):
    root, _, ranks = loaded
    sizes = _hf_sizes(root / name / "hf")
    tied = _hf_configs()[name].tie_word_embeddings

    def layers(lo: int, hi: int) -> int:
        return sum(
            v
            for k, v in sizes.items()
            if k.startswith("model.layers.") and lo <= int(k.split(".")[2]) < hi
        )

    first = layers(0, 2) + sizes["model.embed_tokens.weight"]
    last = layers(2, 4) + sizes["model.norm.weight"]
    last += sizes["model.embed_tokens.weight" if tied else "lm_head.weight"]
    assert [r["pp2", name]["bytes"] for r in ranks] == [first, last]


def test_bad_input_is_one_line_naming_the_file(loaded):
    root, single, _ = loaded
    errors = single["errors"]
    for message in errors.values():
        assert "\n" not in message and str(root / "bad") in message, message
    assert "config.json" in errors["no_config"]
    assert "'gpt2' is not supported" in errors["model_type"]
    assert "llama" in errors["model_type"] and "qwen3_moe" in errors["model_type"]
    assert "model.layers.1.mlp.up_proj.weight" in errors["missing"]
    assert "model.safetensors" in errors["missing"]
    assert "model.norm.weight" in errors["shape"] and "(65,)" in errors["shape"]


def _megatron_shard(name: str, full: torch.Tensor, rank: int, size: int, axis) -> torch.Tensor:
    """Megatron's TP shard of a whole tensor: a contiguous block along its axis, except fc1,
    whose gate and up halves are sharded separately (megatron-core's swiglu sharding)."""
    if axis is None:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]])
    return full.chunk(size, dim=axis)[rank]


@pytest.mark.parametrize("size", [1, 2, 4])
def test_slices_make_megatrons_shards_at_tp4(size):
    """Pure: for every tensor of a Qwen2 layer (4 query groups, qkv biases) and the padded
    vocabulary, the slices of rank r, each put in its place, equal rank r's block of the whole
    tensor the converter makes (`to_megatron`)."""
    from megatron_kto.conversion.addressing import LOCAL_NORMS, fill, megatron_sources, shard_reads
    from megatron_kto.conversion.hf_config import architecture_from_hf
    from megatron_kto.conversion.hf_dir import padded_vocab
    from megatron_kto.conversion.mappings import to_megatron
    from megatron_kto.conversion.registry import get_family

    config = _hf_configs()["qwen2"].to_dict() | {"num_key_value_heads": 4, "num_hidden_layers": 1}
    arch = architecture_from_hf(config)
    arch.padded_vocab_size = padded_vocab(arch.vocab_size)
    generator = torch.Generator().manual_seed(0)
    hf: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:  # a random tensor of the right shape, made on demand
        shapes = {"embed_tokens": (VOCAB, 64), "lm_head": (VOCAB, 64), "q_proj.weight": (64, 64),
                  "q_proj.bias": (64,), "k_proj.weight": (64, 64), "k_proj.bias": (64,),
                  "v_proj.weight": (64, 64), "v_proj.bias": (64,), "o_proj": (64, 64),
                  "gate_proj": (96, 64), "up_proj": (96, 64), "down_proj": (64, 96)}  # fmt: skip
        shape = next((s for k, s in shapes.items() if k in name), (64,))
        return hf.setdefault(name, torch.randn(shape, generator=generator))

    whole = dict(to_megatron(get, arch, arch.padded_vocab_size, LOCAL_NORMS, "qwen2"))
    sources = megatron_sources(arch, LOCAL_NORMS, get_family("qwen2"))
    assert set(whole) <= set(sources)
    for name, full in whole.items():
        source = sources[name]
        for rank in range(size):
            want = _megatron_shard(name, full, rank, size, source.tp_axis)
            reads = shard_reads(source, arch, tuple(want.shape), rank, size)
            got = torch.full_like(want, float("nan"))
            for i, r in enumerate(reads):
                index = [slice(None)] * hf[r.name].dim()
                if r.axis is not None:
                    index[r.axis] = slice(r.start, r.stop)
                fill(source, arch, got, i, hf[r.name][tuple(index)], size)
            assert torch.equal(got, want), (name, rank, size)
