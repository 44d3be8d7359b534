"""Tokenizers (bundled SentencePiece model, a tiny HF tokenizer.json built here), chat templates,
and the prompt/completion encoding rules (exact boundary, BOS/EOS, conversational split)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_kto.data.chat_template import ChatTemplate, ChatTemplateError
from megatron_kto.data.encoding import encode_rendered, render_example
from megatron_kto.data.errors import DataFormatError, RowLocation
from megatron_kto.data.tokenizers import Tokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
SP_MODEL = str(REPO / "examples" / "data" / "tokenizer" / "tiny_sp.model")
CHATML = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "hello world, hello again. the world is wide and the words are many.",
    "a quick brown fox jumps over the lazy dog; the dog sleeps.",
] * 20
WHERE = RowLocation("data.jsonl", 7)


def build_hf_tokenizer(directory: Path, config: dict | None = None) -> Path:
    """Train a tiny byte-level BPE tokenizer into ``directory``; optionally write its config."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>",
              "chat_template": CHATML}  # fmt: skip
    return build_hf_tokenizer(tmp_path_factory.mktemp("hf"), config)


@pytest.fixture(scope="module")
def sp() -> Tokenizer:
    return load_tokenizer("sentencepiece", SP_MODEL)


def encode(tok: Tokenizer, prompt, completion) -> tuple[list[int], list[int]]:
    rendered = render_example(tok, prompt, [completion], WHERE, ["completion"])
    (encoded,) = encode_rendered(tok, [rendered])
    return encoded.prompt_ids, encoded.completion_ids[0]


# ----------------------------------------------------------------------------- tokenizers


def test_bundled_sentencepiece_model(sp):
    assert isinstance(sp, Tokenizer)
    assert (sp.pad_id, sp.bos_id, sp.eos_id, sp.vocab_size) == (0, 2, 3, 384)
    ids = sp.encode("Name two fruit words .")
    assert sp.decode(ids) == "Name two fruit words ."
    assert sp.encode_batch(["a b", "apple ."]) == [sp.encode("a b"), sp.encode("apple .")]
    # Special-token strings in text become their single id, as in Hugging Face tokenizers.
    assert sp.encode("<s>apple</s>") == [2, *sp.encode("apple"), 3]
    assert sp.encode_batch(["<s>apple", "apple"]) == [[2, *sp.encode("apple")], sp.encode("apple")]


def test_huggingface_directory_with_config(hf_dir):
    tok = load_tokenizer("huggingface", str(hf_dir))
    vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (vocab["<pad>"], vocab["<s>"], vocab["</s>"])
    assert tok.vocab_size == len(vocab)
    ids = tok.encode("hello world")
    assert tok.decode(ids) == "hello world" and tok.bos_id not in ids  # no automatic specials
    assert tok.encode("<|im_end|>") == [vocab["<|im_end|>"]]
    assert tok.encode_batch(["hello", "world"]) == [tok.encode("hello"), tok.encode("world")]
    # The file itself also works, and picks up the config beside it.
    assert (
        load_tokenizer("huggingface", str(hf_dir / "tokenizer.json")).fingerprint == tok.fingerprint
    )


def test_huggingface_config_variants(tmp_path):
    bare = build_hf_tokenizer(tmp_path / "bare")  # no tokenizer_config.json: <s>/</s>/<pad> names
    tok = load_tokenizer("huggingface", str(bare))
    assert tok.bos_id is not None and tok.eos_id is not None
    no_bos = build_hf_tokenizer(tmp_path / "nobos", {"eos_token": "</s>", "bos_token": None})
    tok = load_tokenizer("huggingface", str(no_bos))
    assert tok.bos_id is None and tok.pad_id == tok.eos_id  # pad falls back to EOS
    off = build_hf_tokenizer(
        tmp_path / "off", {"eos_token": "</s>", "bos_token": "<s>", "add_bos_token": False}
    )
    assert load_tokenizer("huggingface", str(off)).bos_id is None
    bad = build_hf_tokenizer(tmp_path / "bad", {"eos_token": "<|eot|>"})
    with pytest.raises(ValueError, match="eos_token '<\\|eot\\|>' is not in the vocabulary"):
        load_tokenizer("huggingface", str(bad))
    none = build_hf_tokenizer(tmp_path / "none", {"bos_token": "<s>"})
    with pytest.raises(ValueError, match="no EOS token"):
        load_tokenizer("huggingface", str(none))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer("huggingface", str(tmp_path))
    with pytest.raises(ValueError, match="unknown tokenizer library 'tiktoken'"):
        load_tokenizer("tiktoken", str(bare))


def test_fingerprint_tracks_the_chat_template(hf_dir, tmp_path):
    base = load_tokenizer("huggingface", str(hf_dir))
    other = load_tokenizer("huggingface", str(hf_dir), chat_template="{{ messages[0]['content'] }}")
    assert base.fingerprint != other.fingerprint
    template_file = tmp_path / "t.jinja"
    template_file.write_text("{{ messages[0]['content'] }}")
    from_file = load_tokenizer("huggingface", str(hf_dir), chat_template=str(template_file))
    assert from_file.fingerprint == other.fingerprint
    assert from_file.apply_chat_template([{"role": "user", "content": "x"}], False) == "x"


# ----------------------------------------------------------------------------- chat templates


def test_chat_template_rendering_and_errors():
    template = ChatTemplate(CHATML, bos_token="<s>", eos_token="</s>")
    messages = [{"role": "user", "content": "hi"}]
    assert (
        template.render(messages, True)
        == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not template.render(messages, False).endswith("assistant\n")
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        template.render([{"role": "tool", "content": "x"}], False)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    # The sandbox refuses to call unsafe attributes.
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ChatTemplate("{{ messages.__class__.__subclasses__() }}").render(messages, False)
    assert ChatTemplate("{{ messages | tojson }}").render(
        [{"role": "u", "content": "é"}], False
    ) == ('[{"role": "u", "content": "é"}]')


def test_sentencepiece_needs_an_explicit_chat_template(sp):
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        sp.apply_chat_template([{"role": "user", "content": "x"}], True)


# ----------------------------------------------------------------------------- encoding


def test_boundary_is_exact_no_token_straddles_it(hf_dir):
    tok = load_tokenizer("huggingface", str(hf_dir))
    prompt, completion = "hello wor", "ld again"
    prompt_ids, completion_ids = encode(tok, prompt, completion)
    assert prompt_ids == [tok.bos_id, *tok.encode(prompt)]
    assert completion_ids == [*tok.encode(completion), tok.eos_id]
    assert tok.decode(prompt_ids[1:]) == prompt and tok.decode(completion_ids[:-1]) == completion
    # Joint tokenisation would merge across the boundary; separate tokenisation must not.
    assert tok.encode(prompt + completion) != prompt_ids[1:] + completion_ids[:-1]


def test_sentencepiece_bos_and_eos_added_once(sp):
    prompt_ids, completion_ids = encode(sp, "Name two fruit words .", "apple , plum .")
    assert prompt_ids[0] == sp.bos_id and prompt_ids.count(sp.bos_id) == 1
    assert completion_ids[-1] == sp.eos_id and completion_ids.count(sp.eos_id) == 1
    # Text that already carries them is not doubled.
    prompt_ids2, completion_ids2 = encode(sp, "<s>Name two fruit words .", "apple , plum .</s>")
    assert prompt_ids2 == prompt_ids and completion_ids2 == completion_ids


def test_conversational_split_with_template_bos(hf_dir):
    tok = load_tokenizer("huggingface", str(hf_dir))
    prompt = [{"role": "user", "content": "hello"}]
    completion = [{"role": "assistant", "content": "world"}]
    rendered = render_example(tok, prompt, [completion], WHERE, ["completion"])
    assert rendered.prompt == "<s><|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert rendered.completions == ("world<|im_end|>\n",)
    prompt_ids, completion_ids = encode(tok, prompt, completion)
    assert prompt_ids.count(tok.bos_id) == 1 and prompt_ids[0] == tok.bos_id  # template's BOS
    assert completion_ids[-1] == tok.eos_id
    assert (
        tok.decode(prompt_ids + completion_ids)
        == rendered.prompt + rendered.completions[0] + "</s>"
    )


def test_conversational_with_sentencepiece_and_explicit_template(sp):
    tok = load_tokenizer(
        "sentencepiece",
        SP_MODEL,
        chat_template="{{ bos_token }}" + "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    )
    prompt_ids, _ = encode(
        tok, [{"role": "user", "content": "Name"}], [{"role": "assistant", "content": "apple"}]
    )
    assert prompt_ids[0] == tok.bos_id and prompt_ids.count(tok.bos_id) == 1


def test_template_that_breaks_the_prompt_prefix_is_an_error(hf_dir):
    tok = load_tokenizer(
        "huggingface",
        str(hf_dir),
        chat_template="{% if add_generation_prompt %}GEN:{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    with pytest.raises(DataFormatError) as err:
        encode(tok, [{"role": "user", "content": "q"}], [{"role": "assistant", "content": "a"}])
    assert str(err.value).startswith("data.jsonl:7: completion: the chat template renders")


def test_template_refusal_names_the_row(hf_dir):
    tok = load_tokenizer("huggingface", str(hf_dir))
    with pytest.raises(DataFormatError) as err:
        encode(tok, [{"role": "wizard", "content": "q"}], [{"role": "assistant", "content": "a"}])
    assert str(err.value) == "data.jsonl:7: prompt: unknown role wizard"


def test_conversational_kto_dataset_end_to_end(hf_dir, tmp_path):
    from megatron_kto.data.dataset import build_kto_dataset

    tok = load_tokenizer("huggingface", str(hf_dir))
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    rows = [
        {
            "prompt": prompt,
            "completion": [{"role": "assistant", "content": "world"}],
            "label": True,
        },
        {
            "prompt": prompt,
            "completion": [{"role": "assistant", "content": "again"}],
            "label": False,
        },
        {
            "prompt": [{"role": "robot", "content": "x"}],
            "completion": [{"role": "assistant", "content": "y"}],
            "label": True,
        },
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataFormatError, match=r"chat.jsonl:3: prompt: unknown role robot"):
        build_kto_dataset(path, tok, max_length=128, use_cache=False)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    dataset, stats = build_kto_dataset(path, tok, max_length=128, use_cache=False)
    assert stats.examples == 2
    item = dataset[0]
    expected_prompt = tok.apply_chat_template(prompt, add_generation_prompt=True)
    assert tok.decode(item["prompt_ids"]) == expected_prompt
    assert tok.decode(item["completion_ids"]) == "world<|im_end|>\n</s>"
