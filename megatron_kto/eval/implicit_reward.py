"""Implicit rewards of a trained policy on a labelled data set.

For an example (x, y), ℓ(y|x) is the summed log-probability of the completion tokens (prompt
and padding masked, exactly as in training), and the implicit reward is β·(ℓ_policy − ℓ_ref).
A reference-free objective (CPO, SimPO, ORPO) has no reference: its reward is the policy's own
β·ℓ_policy (per-token mean ℓ for SimPO and ORPO, as TRL's trainers log it), and no reference
pass is run.
A policy that learned the preference gives desirable examples higher rewards than undesirable
ones; `classification.summarize` measures how well (AUC, accuracy, mean reward per class).

Runs under any TP/PP/CP/DP layout (call `init_runtime` first): the policy weights are loaded,
every example's ℓ is computed forward-only, then the reference weights are loaded into the
same model chunks and the pass repeats — one model's memory. Examples are dealt to
data-parallel ranks in contiguous blocks and the results all-reduced, so every rank returns
the full table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_kto.checkpointing.errors import CheckpointError
from megatron_kto.checkpointing.model_io import read_architecture
from megatron_kto.checkpointing.pretrained import resolve_pretrained_dir, restore_pretrained
from megatron_kto.config.architecture import GPTArchitecture
from megatron_kto.data.collate import IGNORE_INDEX, inputs_and_labels
from megatron_kto.data.dataset import KTODataset, build_kto_dataset
from megatron_kto.data.tokenizers import Tokenizer
from megatron_kto.models.builder import ParallelLayout, build_gpt_chunks
from megatron_kto.models.forward import (
    LOGP_SUM,
    NUM_TOKENS,
    data_parallel_all_reduce,
    forward_sequence_stats,
)
from megatron_kto.models.output_head import DEFAULT_LOGPROB_CHUNK_SIZE
from megatron_kto.models.packing import DEFAULT_PACK_SEQUENCES
from megatron_kto.peft.checkpoint import build_lora_model, is_lora_checkpoint, lora_base_dir
from megatron_kto.peft.wiring import adapters_disabled
from megatron_kto.runtime.distributed import Runtime

#: The forward passes here pack their micro-batches as training does by default
#: (`forward_sequence_stats`), so the attention backend must take packed rows.
PACKED_PASSES = DEFAULT_PACK_SEQUENCES


@dataclass
class ImplicitRewards:
    """Per-example results, in data-file order ([N] numpy arrays)."""

    rewards: np.ndarray
    """β·(policy_logps − reference_logps)."""
    policy_logps: np.ndarray
    """Summed completion log-probs under the policy."""
    reference_logps: np.ndarray | None
    """Summed completion log-probs under the reference (None: reference-free)."""
    num_tokens: np.ndarray
    """Completion tokens scored."""
    labels: np.ndarray
    """True for desirable examples."""


def collate_rows(
    examples: Sequence[dict], pad_id: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Right-padded tokens, prompt-masked labels and positions of KTO examples (no KL rows)."""
    pairs = [inputs_and_labels(e["prompt_ids"], e["completion_ids"]) for e in examples]
    length = max(len(tokens) for tokens, _ in pairs)
    tokens = torch.full((len(pairs), length), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), length), IGNORE_INDEX, dtype=torch.long)
    for i, (t, lab) in enumerate(pairs):
        tokens[i, : len(t)] = torch.as_tensor(t)
        labels[i, : len(lab)] = torch.as_tensor(lab)
    positions = torch.arange(length, dtype=torch.long).expand(len(pairs), length).contiguous()
    return {
        "tokens": tokens.to(device),
        "labels": labels.to(device),
        "position_ids": positions.to(device),
    }


def sequence_logps(
    chunks: list[torch.nn.Module],
    dataset: KTODataset,
    runtime: Runtime,
    pad_id: int,
    vocab_size: int,
    batch_size: int = 8,
) -> torch.Tensor:
    """Summed completion log-probs and token counts of every example under `chunks`.

    Collective over the job: every rank must call it with the same arguments.

    Args:
        chunks: this rank's model chunks (unwrapped or DDP-wrapped).
        dataset: the examples.
        runtime: this rank's runtime.
        pad_id: padding token id.
        vocab_size: the real vocabulary size (padded logit columns are left out).
        batch_size: examples per forward pass on each data-parallel rank.

    Returns:
        [N, 2] float64 on the CPU: (log-prob sum, completion tokens), identical on every rank.
    """
    n = len(dataset)
    table = torch.zeros(n, 2, dtype=torch.float64, device=runtime.device)
    dp_rank, dp_size = runtime.data_parallel_rank, runtime.data_parallel_size
    for start in range(dp_rank * batch_size, n, dp_size * batch_size):
        rows = range(start, min(start + batch_size, n))
        batch = collate_rows([dataset[i] for i in rows], pad_id, runtime.device)
        stats = forward_sequence_stats(
            chunks,
            batch["tokens"],
            batch["labels"],
            batch["position_ids"],
            len(rows),
            vocab_size,
            DEFAULT_LOGPROB_CHUNK_SIZE,
            pack=PACKED_PASSES,
        )
        table[rows.start : rows.stop, 0] = stats[:, LOGP_SUM].double()
        table[rows.start : rows.stop, 1] = stats[:, NUM_TOKENS].double()
    data_parallel_all_reduce(table)  # each row was filled by exactly one DP rank
    return table.cpu()


def _architecture(policy_dir: Path, reference_dir: Path, vocab_size: int) -> GPTArchitecture:
    arch = read_architecture(policy_dir)
    ref_arch = read_architecture(reference_dir)
    if arch.to_dict() != ref_arch.to_dict():
        differ = sorted(k for k, v in arch.to_dict().items() if ref_arch.to_dict()[k] != v)
        raise CheckpointError(
            f"{reference_dir}: reference architecture differs from the policy's ({policy_dir}) "
            f"in {differ}"
        )
    if arch.vocab_size is not None and arch.vocab_size < vocab_size:
        raise CheckpointError(
            f"{policy_dir}: model vocabulary ({arch.vocab_size}) is smaller than the "
            f"tokenizer's ({vocab_size}) — wrong tokenizer?"
        )
    return arch


def implicit_rewards(
    policy: str | Path,
    reference: str | Path | None,
    data_files: Sequence[str | Path],
    tokenizer: Tokenizer,
    runtime: Runtime,
    beta: float,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    truncation_mode: str = "keep_end",
    batch_size: int = 8,
    use_cache: bool = True,
    precision: str = "32",
    attention_backend: str = "auto",
    average_log_probs: bool = False,
) -> ImplicitRewards:
    """Implicit rewards of every example of `data_files` (collective over the job).

    Args:
        policy: trained checkpoint: a `step_<N>` dir, a checkpoints root or run dir (its newest
            complete checkpoint), or a model_io checkpoint.
        reference: the reference weights, same forms (typically the run's
            `pretrained_checkpoint.restore_from_path`); None for a reference-free objective:
            the rewards are β·ℓ_policy and no reference pass runs.
        data_files: labelled data in any supported format (unpaired, NeMo-Aligner, paired —
            a pair gives one desirable and one undesirable example).
        tokenizer: the training tokenizer.
        runtime: from `init_runtime` (its TP/PP layout is used to build the model).
        beta: β of the run (scales rewards; AUC does not depend on it).
        max_length, max_prompt_length, truncation_mode: the training length policy, so that
            each example is scored on the same tokens as in training (max_length None means
            the model's encoder_seq_length).
        batch_size: examples per forward pass per data-parallel rank.
        use_cache: use/write the tokenised cache beside the data files (as training does).
        precision: '32', 'bf16' or '16' (the model's parameters and compute).
        attention_backend: 'auto', 'te', 'sdpa' or 'local' (`runtime.attention_backend`;
            the passes are packed, so 'local' is refused).
        average_log_probs: rewards from per-token mean log-probs (SimPO, ORPO, or a run with
            `preference_average_log_probs`); `policy_logps` stay sums.

    Returns:
        Per-example rewards, log-probs, token counts and labels.

    Raises:
        CheckpointError: missing/incompatible checkpoints.
        DataFormatError: a bad data row (one line, file:line).
    """
    policy_dir = resolve_pretrained_dir(policy)
    reference_dir = resolve_pretrained_dir(reference) if reference is not None else None
    arch = _architecture(policy_dir, reference_dir or policy_dir, tokenizer.vocab_size)
    if arch.vocab_size is None:
        arch.vocab_size = tokenizer.vocab_size
    dist = torch.distributed
    dataset, _ = build_kto_dataset(
        [Path(p) for p in data_files],
        tokenizer,
        max_length or arch.encoder_seq_length,  # as training does
        max_prompt_length=max_prompt_length,
        truncation_mode=truncation_mode,
        is_cache_writer=runtime.local_rank == 0,
        barrier=dist.barrier if dist.is_initialized() else None,
        use_cache=use_cache,
    )
    layout = ParallelLayout(
        tensor_model_parallel_size=runtime.tensor_parallel_size,
        pipeline_model_parallel_size=runtime.pipeline_parallel_size,
        virtual_pipeline_model_parallel_size=runtime.virtual_pipeline_parallel_size,
        precision=precision,
        attention_backend=attention_backend,
        pack_sequences=PACKED_PASSES,
        expert_model_parallel_size=runtime.expert_parallel_size,
        expert_tensor_parallel_size=runtime.expert_tensor_parallel_size,
        context_parallel_size=runtime.context_parallel_size,
    )
    chunks = build_gpt_chunks(arch, layout, runtime.device)

    def logps() -> torch.Tensor:
        return sequence_logps(
            chunks, dataset, runtime, tokenizer.pad_id, arch.vocab_size, batch_size
        )

    if is_lora_checkpoint(policy_dir):
        # A LoRA run: policy = its base + adapters; the reference, when it is that base, is the
        # same model with the adapters off (no second load).
        build_lora_model(policy_dir, chunks, arch)
        tables = [logps()]
        if reference_dir is None:
            pass
        elif lora_base_dir(policy_dir) == reference_dir:
            with adapters_disabled(chunks):
                tables.append(logps())
        else:
            chunks = build_gpt_chunks(arch, layout, runtime.device)
            restore_pretrained(reference_dir, chunks)  # a checkpoint or a Hugging Face dir
            tables.append(logps())
    else:
        tables = []
        for weights in (policy_dir, reference_dir):
            if weights is not None:
                restore_pretrained(weights, chunks)
                tables.append(logps())
    policy_logps = tables[0][:, 0].numpy()
    num_tokens = tables[0][:, 1].numpy().astype(np.int64)
    reference_logps = tables[1][:, 0].numpy() if reference_dir is not None else None
    ratio = policy_logps - reference_logps if reference_logps is not None else policy_logps
    if average_log_probs:
        ratio = ratio / np.maximum(num_tokens, 1)
    return ImplicitRewards(
        rewards=beta * ratio,
        policy_logps=policy_logps,
        reference_logps=reference_logps,
        num_tokens=num_tokens,
        labels=np.asarray(dataset.labels, dtype=bool),
    )
