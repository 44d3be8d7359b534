"""Convert between Hugging Face model directories and megatron_kto checkpoints.

    python tools/convert_checkpoint.py import --hf-dir /models/Meta-Llama-3-8B --out /ckpt/llama3_8b
    python tools/convert_checkpoint.py export --ckpt runs/kto/checkpoints --out /models/llama3_8b_kto

`import` reads config.json + safetensors (Llama/Llama-3, Mistral, Qwen2, Qwen3,
Qwen3-MoE, Mixtral) and writes a checkpoint
for `pretrained_checkpoint.restore_from_path` (any TP/PP/DP layout); tokenizer files are copied.
It runs in one process (no torchrun): the whole model is built once, in float32 unless
`--dtype bfloat16`, and filled one safetensors tensor at a time.
`export` writes config.json + safetensors (+ tokenizer files) that `transformers` loads; a run
or checkpoints directory means its latest complete checkpoint. A LoRA run exports as a Hugging
Face PEFT adapter directory (adapter_config.json + adapter_model.safetensors, for
`peft.PeftModel.from_pretrained` on the base model; only the checkpoint's adapter tensors are
read, the base is neither built nor needed), or with `--merge-lora` as a plain model with the
adapters merged into the weights (the whole base is built, as for a full export). Bad input: one `error:` line,
exit code 2.
"""

from __future__ import annotations

import argparse
import sys


class _Parser(argparse.ArgumentParser):
    """Usage mistakes are bad input too: one `error:` line, exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    imp = sub.add_parser("import", help="Hugging Face directory -> megatron_kto checkpoint")
    imp.add_argument("--hf-dir", required=True, help="directory with config.json and safetensors")
    imp.add_argument("--out", required=True, help="new checkpoint directory")
    imp.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="stored weights (float32 is exact for any source; bfloat16 halves memory and disk)",
    )
    exp = sub.add_parser("export", help="megatron_kto checkpoint -> Hugging Face directory")
    exp.add_argument("--ckpt", required=True, help="checkpoint, checkpoints/ or run directory")
    exp.add_argument("--out", required=True, help="new Hugging Face model directory")
    from megatron_kto.conversion.registry import supported

    exp.add_argument("--model-type", choices=supported(), default=None)
    exp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    exp.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file")
    exp.add_argument(
        "--merge-lora",
        action="store_true",
        help="LoRA runs: write the base with the adapters merged in (default: a PEFT adapter)",
    )
    args = parser.parse_args(argv)
    from megatron_kto.console import quiet_third_party

    quiet_third_party()

    from megatron_kto.checkpointing.errors import CheckpointError
    from megatron_kto.conversion import ConversionError
    from megatron_kto.hf_writer.convert import export_hf, import_hf

    try:
        if args.command == "import":
            arch = import_hf(args.hf_dir, args.out, dtype=args.dtype)
            print(
                f"imported {args.hf_dir} -> {args.out}: {arch.num_layers} layers, hidden "
                f"{arch.hidden_size}, vocab {arch.vocab_size} (padded {arch.padded_vocab_size})"
            )
        else:
            from megatron_kto.hf_writer.lora_export import (
                export_adapter,
                export_merged,
                is_lora_run,
            )

            lora = is_lora_run(args.ckpt)
            if args.merge_lora and not lora:
                raise ConversionError(f"--merge-lora: {args.ckpt} is not a LoRA run")
            if lora and not args.merge_lora:
                source = export_adapter(args.ckpt, args.out)
                print(f"exported the LoRA adapter of {source} -> {args.out} (PEFT format)")
                return 0
            source = (export_merged if lora else export_hf)(
                args.ckpt,
                args.out,
                model_type=args.model_type,
                dtype=args.dtype,
                max_shard_bytes=int(args.max_shard_gb * 1024**3),
            )
            print(f"exported {source} -> {args.out}" + (" (LoRA merged)" if lora else ""))
    except (ConversionError, CheckpointError, OSError) as e:
        # OSError: unreadable input or unwritable output (permissions, a file in the way).
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
