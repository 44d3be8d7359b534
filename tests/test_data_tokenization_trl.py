"""Our token ids are the ids `transformers` and TRL 1.16 train on (DESIGN §1, "Tokenisation
follows the tokenizer").

Four tokenizer conventions are built here with the `tokenizers` library (a small byte-level or
Metaspace BPE trained on a toy corpus, plus a `tokenizer_config.json`; nothing is downloaded) and
loaded by `transformers.AutoTokenizer` exactly as a Hub model would be:

* ``llama3``: BOS added by the tokenizer.json post-processor (``TemplateProcessing``), a
  Llama-3-style chat template that renders ``bos_token`` itself;
* ``chatml``: SmolLM2/Qwen style — ``bos_token`` set in the config but *not* added (no
  ``add_bos_token``; the post-processor adds nothing), ``eos_token = <|im_end|>``, a ChatML
  template ending each turn with ``<|im_end|>\\n``;
* ``gpt2``: bos = eos = ``<|endoftext|>``, nothing added;
* ``llama2``: Metaspace pre-tokenizer (``prepend_scheme: first``) and a post-processor adding
  ``<s>`` — the convention under which tokenising prompt and completion separately goes wrong.

TRL's own preprocessing is called — `KTOTrainer._prepare_dataset` / `DPOTrainer._prepare_dataset`
(TRL 1.16: EOS appended to plain completions, prompt and prompt+completion tokenised with
`_tokenize`, completion after `common_prefix_length`) — on a stand-in for the trainer holding
only the attributes that method reads; no model is built. For every convention, for plain and
conversational rows, unpaired (KTO) and paired (DPO), our ``prompt_ids``/``completion_ids``
must equal TRL's, and ``prompt_ids + completion_ids`` must equal what the `transformers`
tokenizer itself gives for the whole text.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from megatron_kto.data.dataset import build_dpo_dataset, build_kto_dataset
from megatron_kto.data.tokenizers import load_tokenizer

CORPUS = [
    "hello world, how are you? the quick brown fox jumps over the lazy dog.",
    "hello again world. a quick question: what is the answer? the answer is here.",
    "be brief. naïve café résumé, again and again.",
] * 30

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %} {{ m['content'] }} "
    "{{ eos_token }}{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}{% endfor %}"
)

#: name -> (special tokens, BOS added by the post-processor, config, chat template, Metaspace)
CONVENTIONS = {
    "llama3": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
         "<|end_header_id|>"],
        "<|begin_of_text|>",
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
         "tokenizer_class": "PreTrainedTokenizerFast"},
        LLAMA3_TEMPLATE,
        False,
    ),
    "chatml": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        None,
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
         "unk_token": "<|endoftext|>", "tokenizer_class": "GPT2Tokenizer"},
        CHATML_TEMPLATE,
        False,
    ),
    "gpt2": (
        ["<|endoftext|>"],
        None,
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
         "unk_token": "<|endoftext|>", "tokenizer_class": "GPT2Tokenizer"},
        PLAIN_TEMPLATE,
        False,
    ),
    "llama2": (
        ["<unk>", "<s>", "</s>"],
        "<s>",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "tokenizer_class": "PreTrainedTokenizerFast"},
        LLAMA2_TEMPLATE,
        True,
    ),
}  # fmt: skip


def build_convention(directory: Path, name: str) -> Path:
    """Train the toy tokenizer of convention `name` into `directory` (tokenizer.json + config)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials, added_bos, config, template, metaspace = CONVENTIONS[name]
    tok = Tokenizer(models.BPE(unk_token="<unk>" if metaspace else None))
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet: list[str] = []
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    if added_bos is not None:
        bos = (added_bos, tok.token_to_id(added_bos))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{added_bos} $A", pair=f"{added_bos} $A {added_bos} $B", special_tokens=[bos]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": template})
    )
    return directory


def plain_rows(eos: str) -> list[dict]:
    return [
        {"prompt": "hello world,", "completion": " how are you?", "label": True},
        {"prompt": "the quick brown", "completion": " fox jumps", "label": False},
        # Tokens merge across the seam: TRL starts the completion where the ids diverge.
        {"prompt": "hello wor", "completion": "ld again", "label": True},
        {"prompt": "a quick question:", "completion": " the answer" + eos, "label": False},
        {"prompt": "naïve café", "completion": " résumé.", "label": True},
    ]


CHAT_ROWS = [
    {
        "prompt": [
            {"role": "system", "content": "be brief."},
            {"role": "user", "content": "hello world, how are you?"},
        ],
        "completion": [{"role": "assistant", "content": "the answer is here."}],
        "label": True,
    },
    {
        "prompt": [
            {"role": "user", "content": "a quick question:"},
            {"role": "assistant", "content": "what is the answer?"},
            {"role": "user", "content": "hello again"},
        ],
        "completion": [{"role": "assistant", "content": "the lazy dog."}],
        "label": False,
    },
]


def paired(rows: list[dict]) -> list[dict]:
    """Pairs (row 2k chosen, row 2k+1 rejected) with row 2k's prompt."""
    return [
        {"prompt": a["prompt"], "chosen": a["completion"], "rejected": b["completion"]}
        for a, b in zip(rows[::2], rows[1::2])
    ]


@pytest.fixture(scope="module")
def trl_prepare(tmp_path_factory):
    """`prepare(kind, hf_tokenizer, rows) -> list of dicts` through TRL 1.16's own code."""
    import datasets
    from trl import DPOConfig, KTOConfig
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.kto_trainer import KTOTrainer

    datasets.disable_progress_bars()
    out = tmp_path_factory.mktemp("trl")
    common = {"use_cpu": True, "bf16": False, "report_to": [], "max_length": None}
    configs = {
        "kto": KTOConfig(output_dir=str(out / "kto"), per_device_train_batch_size=2, **common),
        "dpo": DPOConfig(output_dir=str(out / "dpo"), **common),
    }
    trainers = {"kto": KTOTrainer, "dpo": DPOTrainer}

    def prepare(kind: str, hf, rows: list[dict]) -> list[dict]:
        # What `_prepare_dataset` reads from the trainer: the tokenizer and the KL/weight settings.
        stand_in = types.SimpleNamespace(
            _tokenizer=hf, calculate_KL=True, desirable_weight=1.0, undesirable_weight=1.0
        )
        columns = {k: [r[k] for r in rows] for k in rows[0]}
        dataset = datasets.Dataset.from_dict(columns)
        prepared = trainers[kind]._prepare_dataset(stand_in, dataset, hf, configs[kind], "train")
        return [prepared[i] for i in range(len(prepared))]

    return prepare


@pytest.fixture(scope="module", params=list(CONVENTIONS))
def convention(request, tmp_path_factory):
    from transformers import AutoTokenizer

    directory = build_convention(tmp_path_factory.mktemp(request.param) / "tok", request.param)
    hf = AutoTokenizer.from_pretrained(str(directory))
    ours = load_tokenizer("huggingface", str(directory))
    return request.param, directory, hf, ours


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    return path


def test_kto_ids_equal_trl_and_transformers(convention, trl_prepare, tmp_path):
    name, _, hf, ours = convention
    assert ours.eos_id == hf.eos_token_id and ours.eos_token == hf.eos_token
    assert ours.adds_bos == (CONVENTIONS[name][1] is not None)
    for kind, rows in (("plain", plain_rows(hf.eos_token)), ("chat", CHAT_ROWS)):
        dataset, stats = build_kto_dataset(
            write(tmp_path / f"{kind}.jsonl", rows), ours, None, use_cache=False
        )
        expected = trl_prepare("kto", hf, rows)
        assert len(dataset) == len(expected) == len(rows)
        for i, (row, trl_row) in enumerate(zip(rows, expected)):
            got = dataset[i]
            where = f"{name} {kind} row {i}"
            assert got["prompt_ids"] == trl_row["prompt_ids"], where
            assert got["completion_ids"] == trl_row["completion_ids"], where
            whole = got["prompt_ids"] + got["completion_ids"]
            if kind == "plain":
                text = row["prompt"] + row["completion"]
                text += "" if text.endswith(hf.eos_token) else hf.eos_token
                assert whole == hf(text).input_ids, where
                assert got["completion_ids"][-1] == hf.eos_token_id, where
                assert got["completion_ids"].count(hf.eos_token_id) == 1 or name == "gpt2"
            else:
                rendered = hf.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
                assert whole == hf(rendered, add_special_tokens=False).input_ids, where
        if kind == "plain":
            assert stats.prompts_merged == 1  # "hello wor" + "ld again"


def test_kto_ids_bos_and_turn_end_are_never_doubled(convention, tmp_path):
    """The defects of issue 9 item 3, checked directly: no spurious BOS where the tokenizer adds
    none, and a chat completion ends with the template's own end of turn, once."""
    name, _, hf, ours = convention
    plain, _ = build_kto_dataset(
        write(tmp_path / "p.jsonl", plain_rows("")), ours, None, use_cache=False
    )
    chat, _ = build_kto_dataset(write(tmp_path / "c.jsonl", CHAT_ROWS), ours, None, use_cache=False)
    first = plain[0]["prompt_ids"][0]
    if name in ("llama3", "llama2"):
        assert first == hf.bos_token_id and plain[0]["prompt_ids"].count(first) == 1
        assert chat[0]["prompt_ids"].count(hf.bos_token_id) == 1  # the template's own BOS
    else:
        assert first != hf.bos_token_id
    completion = chat[0]["completion_ids"]
    if name == "chatml":
        end = hf.encode("<|im_end|>\n", add_special_tokens=False)
        assert completion[-len(end) :] == end and completion.count(hf.eos_token_id) == 1
    if name == "llama3":
        assert completion[-1] == hf.convert_tokens_to_ids("<|eot_id|>")
        assert completion.count(completion[-1]) == 1


def test_dpo_ids_equal_trl(convention, trl_prepare, tmp_path):
    name, _, hf, ours = convention
    for kind, rows in (
        ("plain", paired(plain_rows(hf.eos_token)[:4])),
        ("chat", paired(CHAT_ROWS)),
    ):
        dataset, _ = build_dpo_dataset(
            write(tmp_path / f"{kind}.jsonl", rows), ours, None, use_cache=False
        )
        expected = trl_prepare("dpo", hf, rows)
        assert len(dataset) == len(expected) == len(rows)
        for i, trl_row in enumerate(expected):
            for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
                assert dataset[i][key] == trl_row[key], f"{name} {kind} pair {i} {key}"


def test_sentencepiece_model_follows_llama_tokenizer_with_bos(trl_prepare, tmp_path):
    """A SentencePiece `.model` carries no rule for special tokens; ours is the Llama/Mistral
    one (BOS first, no EOS added by the tokenizer) — `transformers`' LlamaTokenizer built from
    the same file with ``add_bos_token=True`` gives the same ids through TRL, for every row of
    the bundled validation set."""
    import shutil

    from transformers import LlamaTokenizer

    root = Path(__file__).resolve().parents[1] / "examples" / "data"
    model = root / "tokenizer" / "tiny_sp.model"
    shutil.copy(model, tmp_path / "tokenizer.model")
    hf = LlamaTokenizer.from_pretrained(str(tmp_path), add_bos_token=True, add_eos_token=False)
    ours = load_tokenizer("sentencepiece", str(model))
    data = root / "tiny_kto" / "validation.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    dataset, stats = build_kto_dataset(data, ours, None, use_cache=False)
    expected = trl_prepare("kto", hf, rows)
    assert len(dataset) == len(expected) == 128 and stats.prompts_merged == 0
    for i, trl_row in enumerate(expected):
        assert dataset[i]["prompt_ids"] == trl_row["prompt_ids"], i
        assert dataset[i]["completion_ids"] == trl_row["completion_ids"], i
