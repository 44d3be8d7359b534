"""Family parity against `transformers`: the shared harness of the sigmoid-routed MoE families'
log-prob tests (`test_glm4_moe.py`, `test_deepseek_v3.py`); a family test gives its tiny configs
(an HF config maker) and its own extra checks only.

What it runs, in two process spawns:

* `convert_and_run(root, configs, hooks)`: every config's tiny random model is saved with its
  norms and biases off 1 / 0, decisive routers and non-zero correction biases
  (`sigmoid_moe_references`: HF's logits and expert choices, once with and once without the
  bias); one single-process run (`single_worker`) imports each model, runs it at TP=1 from our
  checkpoint (a different init, so only the checkpoint can match) and straight from the HF
  directory, packs rows, exports; one 2-rank run (`layout_worker`) restores every model in each
  of `LAYOUTS` (TP=2, EP=2, PP=2, and TP=2 x SP x EP=2 x ETP=1, where the TP ranks hold whole
  experts), some also straight from the HF directory;
* the family's `FamilyHooks` add their own results inside those runs (no extra launch).

The checks (`check_single_rank`, `check_parallel`, `check_round_trip`, `check_refused`) are what
both families assert: log-probs within `RELATIVE` of HF's, every MoE layer's expert choices
equal HF's token for token, bit-exact export that `transformers` loads with the same logits, and
one-line refusals.

The other families' conversion tests share the tokens, `perturb`, `hf_logits`, `forward_logits`
(full logits over two micro-batches), `check_logits` and `check_bit_exact`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from hf_tiny import hf_tensors
from multirank import run_multirank

VOCAB, SEQ, BATCH = 100, 24, 4
RELATIVE = 1e-5
#: Row lengths of the packed-vs-padded check.
LENGTHS = [SEQ, SEQ - 5, SEQ - 11, SEQ - 2]


@dataclass(frozen=True)
class Layout:
    """One layout of the 2-rank run."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    """Expert tensor parallel size; None = tp."""
    sp: bool = False
    """Sequence parallel: each TP rank routes its own share of the sequence."""
    hf: bool = False
    """Also restored straight from the HF directory (results under 'hf_<layout>')."""


LAYOUTS = {
    "tp2": Layout(tp=2),
    "ep2": Layout(ep=2, hf=True),
    "pp2": Layout(pp=2),
    # Expert TP apart from TP: the two TP (SP) ranks hold whole experts, half of them each.
    "tp2ep2etp1": Layout(tp=2, ep=2, etp=1, sp=True, hf=True),
}
#: Every key `check_parallel` reads: the layouts, and those restored from HF too.
PARALLEL = [*LAYOUTS, *(f"hf_{name}" for name, lay in LAYOUTS.items() if lay.hf)]


@dataclass(frozen=True)
class FamilyHooks:
    """A family's own checks inside the shared runs: module-level functions (they travel to the
    ranks by reference), each returning {result key: value}.

    single(name, arch, chunks, base): after the TP=1 forward from our checkpoint (`base`: the
        model's directory).
    layout(layout, name, arch, chunks, base): after each layout's forward.
    runs(root, models): once, after the layouts, on the 2 ranks (its own `init_runtime`).
    """

    single: Callable | None = None
    layout: Callable | None = None
    runs: Callable | None = None


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(model_dir: Path) -> torch.Tensor:
    """`transformers`' logits [B, T, V] of `tokens()` (fp32)."""
    with torch.no_grad():
        return hf_model(model_dir)(tokens()).logits.float()


def hf_run(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits [B, T, V], per MoE layer the chosen experts as a [T, B, E] bool map — megatron's
    sequence-major token order)."""
    choices = []

    def hook(module, args, output):
        _, _, indices = output
        chosen = torch.zeros(indices.shape[0], module.num_experts, dtype=torch.bool)
        chosen.scatter_(1, indices, True)
        choices.append(chosen.view(BATCH, SEQ, -1).transpose(0, 1))

    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    handles = [g.register_forward_hook(hook) for g in gates]
    with torch.no_grad():
        logits = model(tokens()).logits.float()
    for h in handles:
        h.remove()
    return logits, choices


def reference_logprobs(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    return logp.gather(-1, tokens()[:, 1:, None])[..., 0].float()


def forward(arch, chunks):
    """(log-probs [B, T-1], per MoE layer of this rank the routing maps [T / SP, B, E]) through
    megatron-core's schedule, one micro-batch; log-probs None off the last pipeline stage."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_kto.models.forward import eval_mode, gpt_forward_step
    from megatron_kto.models.logprobs import token_logprobs
    from megatron_kto.models.schedule import run_schedule

    ids = tokens()
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    batch = {
        "tokens": ids,
        "labels": labels,
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).clone(),
    }
    maps = []
    routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
    handles = [r.register_forward_hook(lambda m, a, out: maps.append(out[1])) for r in routers]
    with torch.no_grad(), eval_mode(chunks):
        results = run_schedule(
            chunks,
            [batch],
            gpt_forward_step(
                lambda b, logits: token_logprobs(logits, b["labels"], arch.vocab_size)[:, :-1]
            ),
            forward_only=True,
            collect_non_loss_data=True,
        )
    for h in handles:
        h.remove()
    # Under SP each TP rank routes its own slice of the sequence.
    maps = [m.reshape(-1, BATCH, m.shape[-1]) for m in maps]
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None, maps
    return results[0], maps


def forward_logits(arch, chunks) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(full logits [B, T, padded V], log-probs [B, T-1]) through megatron-core's schedule, two
    micro-batches; None off the last pipeline stage."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_kto.models.forward import eval_mode, gpt_forward_step
    from megatron_kto.models.logprobs import token_logprobs
    from megatron_kto.models.schedule import run_schedule

    ids = tokens()
    positions = torch.arange(SEQ).expand(BATCH, SEQ).clone()
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    micro = [
        {
            "tokens": ids[i : i + 2],
            "labels": labels[i : i + 2],
            "position_ids": positions[i : i + 2],
        }
        for i in range(0, BATCH, 2)
    ]

    def outputs(batch, logits):
        full = gather_from_tensor_model_parallel_region(logits).clone()
        return full, token_logprobs(logits, batch["labels"], arch.vocab_size)[:, :-1]

    with torch.no_grad(), eval_mode(chunks):
        results = run_schedule(
            chunks, micro, gpt_forward_step(outputs), forward_only=True, collect_non_loss_data=True
        )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])


def packed_vs_padded(arch, chunk) -> float:
    """max |Δ log-prob| between padded rows of different lengths and the same rows packed."""
    from megatron_kto.models.forward import eval_mode, model_call
    from megatron_kto.models.logprobs import token_logprobs
    from megatron_kto.models.packing import PACKED, pack_micro_batch

    ids = tokens().clone()
    labels = torch.full_like(ids, -100)
    for i, n in enumerate(LENGTHS):
        ids[i, n:] = 0
        labels[i, : n - 1] = ids[i, 1:n]
    batch = {
        "tokens": ids,
        "labels": labels,
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).clone(),
    }
    with torch.no_grad(), eval_mode([chunk]):
        padded = token_logprobs(model_call(chunk, batch), labels, arch.vocab_size)
        packed_batch = pack_micro_batch(batch, [n - 1 for n in LENGTHS])
        assert packed_batch[PACKED].num_rows == BATCH
        packed = token_logprobs(model_call(chunk, packed_batch), packed_batch["labels"], VOCAB)
    want = torch.cat([padded[i, : n - 1] for i, n in enumerate(LENGTHS)])
    return (packed.reshape(-1)[: want.numel()] - want).abs().max().item()


def restore_and_run(path: Path, layout: Layout, rt, cp: int = 1) -> tuple:
    """(architecture, chunks) of the checkpoint or HF directory at `path`, built in `layout`."""
    from megatron_kto.checkpointing.model_io import read_architecture
    from megatron_kto.checkpointing.pretrained import restore_pretrained
    from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks

    arch = read_architecture(path)
    parallel = ParallelLayout(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        context_parallel_size=cp,
        sequence_parallel=layout.sp,
        attention_backend="sdpa",
    )
    chunks = build_gpt_chunks(arch, parallel, rt.device)
    restore_pretrained(path, chunks)
    return arch, chunks


def single_worker(rank: int, world_size: int, root: str, models: tuple, hooks: FamilyHooks):
    """Per model: import, TP=1 from the checkpoint (a different init) and from the HF directory
    directly, packed vs padded, the family's own TP=1 results, export."""
    from megatron_kto.hf_writer.convert import export_hf, import_hf
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for name in models:
        base = Path(root) / name
        out["arch", name] = import_hf(base / "hf", base / "mcore").to_dict()
        rt = init_runtime(1, 1, seed=9)  # a different init: only the checkpoint can match
        arch, chunks = restore_and_run(base / "mcore", Layout(), rt)
        out["tp1", name] = forward(arch, chunks)
        out["packed", name] = packed_vs_padded(arch, chunks[0])
        if hooks.single is not None:
            out.update(hooks.single(name, arch, chunks, base))
        teardown()
        rt = init_runtime(1, 1, seed=9)
        out["hf_tp1", name] = forward(*restore_and_run(base / "hf", Layout(), rt))
        teardown()
        export_hf(base / "mcore", base / "export")
    return out


def layout_worker(
    rank: int, world_size: int, root: str, models: tuple, layouts: dict, hooks: FamilyHooks
) -> dict:
    """Every model in every layout from our checkpoint (and from the HF directory where the
    layout says so), then the family's own runs."""
    from megatron_kto.runtime import init_runtime, teardown

    out = {}
    for key, layout in layouts.items():
        rt = init_runtime(
            layout.tp,
            layout.pp,
            seed=9,
            expert_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
        )
        out["sizes", key] = parallel_sizes()
        for name in models:
            base = Path(root) / name
            arch, chunks = restore_and_run(base / "mcore", layout, rt)
            out[key, name] = forward(arch, chunks)
            if hooks.layout is not None:
                out.update(hooks.layout(key, name, arch, chunks, base))
            if layout.hf:
                out[f"hf_{key}", name] = forward(*restore_and_run(base / "hf", layout, rt))
    if hooks.runs is not None:
        out.update(hooks.runs(root, models))
    teardown()
    return out


def parallel_sizes() -> tuple[int, int, int, int]:
    """(TP, PP, EP, ETP) as megatron-core's parallel state has them on this rank."""
    from megatron.core import parallel_state as ps

    kinds = ("tensor_model", "pipeline_model", "expert_model", "expert_tensor")
    return tuple(getattr(ps, f"get_{kind}_parallel_world_size")() for kind in kinds)


def perturb(model, router_suffix: str | None = None, router_std: float = 1.0) -> None:
    """Norms and biases moved off 1 / 0 (every one shows); the routers (parameters ending in
    `router_suffix`) drawn ~N(0, `router_std`): decisive, far from ties."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif router_suffix is not None and pname.endswith(router_suffix):
                p.normal_(0.0, router_std)


def sigmoid_moe_references(root: Path, configs: dict) -> dict:
    """Save each tiny random model of `configs` (norms and biases off 1 / 0, decisive routers,
    non-zero correction biases) under `root / name / "hf"`; per model HF's logits, expert choices,
    logits without the correction bias, and the bias buffers as reloaded."""
    from transformers import AutoModelForCausalLM

    reference = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        perturb(model, "mlp.gate.weight", 0.3)
        with torch.no_grad():
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.copy_(0.3 * torch.randn_like(b))
        model.save_pretrained(root / name / "hf")
        hf = hf_model(root / name / "hf")
        logits, choices = hf_run(hf)
        with torch.no_grad():  # the bias must matter for this test to mean anything
            for bname, b in hf.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.zero_()
        unbiased, _ = hf_run(hf)
        buffers = {
            k: v.clone()
            for k, v in hf_model(root / name / "hf").named_buffers()
            if k.endswith("e_score_correction_bias")
        }
        reference[name] = {
            "logits": logits,
            "choices": choices,
            "unbiased": unbiased,
            "buffers": buffers,
        }
    return reference


def merge_rank_outputs(results: dict, rank_outputs: list[dict], whole: tuple[str, ...]) -> dict:
    """Fold every rank's {key: (log-probs or None, routing maps)} into `results`: the last
    stage's log-probs (TP / EP ranks agree) and every rank's maps in rank order; keys starting
    with one of `whole` are taken as they are (from the first rank)."""
    for rank_out in rank_outputs:
        for key, value in rank_out.items():
            if key[0] in whole:
                results.setdefault(key, value)
                continue
            logprobs, maps = value
            entry = results.setdefault(key, (None, []))
            if logprobs is not None:
                entry = results[key] = (logprobs, entry[1])
            entry[1].append(maps)
    return results


def convert_and_run(
    root: Path, configs: dict, hooks: FamilyHooks, whole: tuple[str, ...] = ()
) -> tuple[Path, dict, dict]:
    """A family test's module fixture: the references, the single-process run and the 2-rank
    run of `LAYOUTS` -> (root, references, results); `whole`: the first key parts of the
    hooks' results that are not (log-probs, maps) pairs."""
    reference = sigmoid_moe_references(root, configs)
    models = tuple(configs)
    results = run_multirank(single_worker, 1, str(root), models, hooks, timeout=600)[0]
    ranks = run_multirank(layout_worker, 2, str(root), models, LAYOUTS, hooks, timeout=600)
    return root, reference, merge_rank_outputs(results, ranks, ("sizes", *whole))


def cases(layouts, models) -> list:
    """pytest parameters (layout, model name) for every pair, with ids '<name>-<layout>'."""
    import pytest

    return [pytest.param(lay, name, id=f"{name}-{lay}") for lay in layouts for name in models]


def check_correction_bias_matters(converted) -> None:
    """Zeroing the correction biases changes HF's logits: the routing tests mean something."""
    _, reference, _ = converted
    for name, ref in reference.items():
        assert (ref["logits"] - ref["unbiased"]).abs().max() > 1e-3, name


def check_single_rank(converted, layout: str, name: str, moe_layers: int) -> None:
    """One rank's log-probs within `RELATIVE` of HF's, and the same experts in every layer."""
    maps = converted[2][layout, name][1]
    assert len(maps) == moe_layers
    _check_logprobs_and_choices(converted, layout, name, [maps])


def check_parallel(converted, layout: str, name: str, layouts: dict = LAYOUTS) -> None:
    """Log-probs from the last stage; every rank's routing maps of the layers it holds (TP and
    EP ranks route the same tokens, PP stages their own layers, SP ranks their own slice of the
    sequence) equal HF's choices; megatron-core's parallel sizes are the `layouts` entry's."""
    results = converted[2]
    shape = layouts[layout.removeprefix("hf_")]
    sizes = (shape.tp, shape.pp, shape.ep, shape.etp or shape.tp)
    assert results["sizes", layout.removeprefix("hf_")] == sizes
    per_rank = results[layout, name][1]
    if shape.pp > 1:  # stage 0 holds the first MoE layers, stage 1 the others
        per_rank = [[m for maps in per_rank for m in maps]]
    elif shape.sp:  # the 2 ranks are the TP ranks: their slices in order make the sequence
        per_rank = [[torch.cat(slices) for slices in zip(*per_rank, strict=True)]]
    _check_logprobs_and_choices(converted, layout, name, per_rank)


def _check_logprobs_and_choices(converted, layout: str, name: str, per_rank: list) -> None:
    """The log-probs within `RELATIVE` of HF's; each of `per_rank`'s lists of routing maps (one
    per MoE layer) equal to HF's expert choices."""
    _, reference, results = converted
    want = reference_logprobs(reference[name]["logits"])
    error = ((results[layout, name][0] - want).abs() / want.abs().clamp(min=1.0)).max().item()
    print(f"{name} {layout}: max relative |Δ logp| {error:.2e}")
    assert error <= RELATIVE
    choices = reference[name]["choices"]
    for maps in per_rank:
        assert len(maps) == len(choices)
        for ours, theirs in zip(maps, choices, strict=True):
            assert torch.equal(ours, theirs)


def check_packed(converted, name: str) -> None:
    assert converted[2]["packed", name] <= 1e-5


def check_logits(converted, layout: str, name: str, tolerance: float) -> torch.Tensor:
    """`forward_logits`' full logits (padded to 128 x 8 rows by the import) and log-probs within
    `tolerance` of `transformers`' (`converted`'s reference: HF's logits per model); returns our
    logits."""
    _, reference, results = converted
    logits, logprobs = results[layout, name]
    assert logits.shape == (BATCH, SEQ, 1024)
    logit_diff = (logits[..., :VOCAB] - reference[name]).abs().max().item()
    logp_diff = (logprobs - reference_logprobs(reference[name])).abs().max().item()
    print(f"{name} {layout}: max|Δ logits| {logit_diff:.2e}, max|Δ logp| {logp_diff:.2e}")
    assert logit_diff <= tolerance and logp_diff <= tolerance
    return logits


def check_bit_exact(source: Path, exported: Path) -> None:
    """The two Hugging Face directories hold the same tensors, bit for bit."""
    original, written = hf_tensors(source), hf_tensors(exported)
    assert written.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(written[key], tensor), key


def check_round_trip(converted, name: str, source, keys: tuple[str, ...]) -> dict:
    """The export's safetensors equal the source's bit for bit, its config.json keeps `keys` of
    the HF config `source`, and `transformers` loads it with the same logits; returns that
    config.json."""
    root, reference, _ = converted
    check_bit_exact(root / name / "hf", root / name / "export")
    config = json.loads((root / name / "export" / "config.json").read_text())
    for key in keys:
        assert config[key] == getattr(source, key), key
    logits, _ = hf_run(hf_model(root / name / "export"))
    assert torch.equal(logits, reference[name]["logits"])
    return config


def config_with(source, rope: dict | None = None, **changes) -> dict:
    """The HF config `source` as a dict with `changes`, and `rope` merged into its
    rope_parameters."""
    config = source.to_dict()
    config.update(changes)
    if rope is not None:
        config["rope_parameters"] = {**config["rope_parameters"], **rope}
    return config


def check_refused(config: dict, message: str) -> None:
    """`architecture_from_hf` refuses `config` in one line that starts with `message`."""
    import pytest

    from megatron_kto.conversion.hf_config import ConversionError, architecture_from_hf

    with pytest.raises(ConversionError) as info:
        architecture_from_hf(config, "cfg.json")
    text = str(info.value)
    assert text.startswith(f"cfg.json: {message}"), text
    assert "\n" not in text
