#!/usr/bin/env python
"""Check, convert and describe KTO/DPO data files.

    python tools/preprocess_kto_data.py validate FILE [FILE ...]
    python tools/preprocess_kto_data.py convert --to unpaired IN OUT
    python tools/preprocess_kto_data.py stats FILE --tokenizer-library sentencepiece \
        --tokenizer-model examples/data/tokenizer/tiny_sp.model [--max-length 512]

Exit codes: 0 success; 1 bad data (one ``file:line: field: problem`` line per bad file on
stderr, no traceback); 2 bad command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_kto.data.chat_template import ChatTemplateError  # noqa: E402
from megatron_kto.data.errors import DataFormatError  # noqa: E402

# Errors that are the user's data or arguments, reported as one line without a traceback.
USER_ERRORS = (
    DataFormatError,
    ChatTemplateError,
    FileNotFoundError,
    ImportError,
    ValueError,
    OSError,
)


def _fail(err: BaseException) -> int:
    print(" ".join(str(err).split()), file=sys.stderr)
    return 1


def cmd_validate(args: argparse.Namespace) -> int:
    from megatron_kto.data.inspection import validate_file

    status = 0
    for path in args.files:
        try:
            print(validate_file(path).summary())
        except USER_ERRORS as err:
            status = _fail(err)
    return status


def cmd_convert(args: argparse.Namespace) -> int:
    from megatron_kto.data.inspection import convert_to_unpaired

    try:
        rows = convert_to_unpaired(args.input, args.output)
    except USER_ERRORS as err:
        return _fail(err)
    print(f"wrote {rows} TRL unpaired rows to {args.output}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from megatron_kto.data.inspection import format_length_report, length_report
    from megatron_kto.data.length_policy import LengthPolicy
    from megatron_kto.data.tokenizers import load_tokenizer

    try:
        tokenizer = load_tokenizer(args.tokenizer_library, args.tokenizer_model, args.chat_template)
        policy = LengthPolicy(args.max_length, args.max_prompt_length, args.truncation_mode)
    except USER_ERRORS as err:
        return _fail(err)
    status = 0
    for path in args.files:
        try:
            print(format_length_report(length_report(path, tokenizer, policy), policy))
        except USER_ERRORS as err:
            status = _fail(err)
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    validate = sub.add_parser("validate", help="check every row of one or more files")
    validate.add_argument("files", nargs="+")
    validate.set_defaults(func=cmd_validate)

    convert = sub.add_parser("convert", help="rewrite paired / NeMo-Aligner data as TRL unpaired")
    convert.add_argument("--to", choices=["unpaired"], required=True, help="target format")
    convert.add_argument("input")
    convert.add_argument("output")
    convert.set_defaults(func=cmd_convert)

    stats = sub.add_parser("stats", help="counts, loss-weight advice and token lengths")
    stats.add_argument("files", nargs="+")
    stats.add_argument(
        "--tokenizer-library", choices=["sentencepiece", "huggingface"], required=True
    )
    stats.add_argument("--tokenizer-model", required=True, help=".model file or tokenizer dir")
    stats.add_argument("--chat-template", default=None, help="Jinja template text or file")
    stats.add_argument("--max-length", type=int, default=None)
    stats.add_argument("--max-prompt-length", type=int, default=None)
    stats.add_argument("--truncation-mode", choices=["keep_end", "keep_start"], default="keep_end")
    stats.set_defaults(func=cmd_stats)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
