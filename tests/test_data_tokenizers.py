"""Tokenizers (bundled SentencePiece model, a tiny HF tokenizer.json built here), chat templates,
and the prompt/completion encoding rules (TRL's: whole text, completion after the common prefix;
BOS/EOS as the tokenizer adds them). Parity with `transformers`/TRL on several tokenizer
conventions is in `test_data_tokenization_trl.py`."""

from __future__ import annotations

import json
import logging
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
    # SentencePiece rule: BOS first when the model has one, never EOS.
    assert sp.adds_bos and sp.encode("Name two", add_special_tokens=True) == [
        2,
        *sp.encode("Name two"),
    ]
    assert sp.encode_batch(["a b"], add_special_tokens=True) == [[2, *sp.encode("a b")]]
    assert sp.eos_token == "</s>"
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
    # bos_token is set but the post-processor adds nothing: neither do we (transformers 5).
    assert not tok.adds_bos and tok.encode("hello world", add_special_tokens=True) == ids
    assert tok.encode("<|im_end|>") == [vocab["<|im_end|>"]]
    assert tok.encode_batch(["hello", "world"]) == [tok.encode("hello"), tok.encode("world")]
    # The file itself also works, and picks up the config beside it.
    assert (
        load_tokenizer("huggingface", str(hf_dir / "tokenizer.json")).fingerprint == tok.fingerprint
    )


def test_huggingface_config_variants(tmp_path, caplog):
    bare = build_hf_tokenizer(tmp_path / "bare")  # no tokenizer_config.json: <s>/</s>/<pad> names
    tok = load_tokenizer("huggingface", str(bare))
    assert tok.bos_id is not None and tok.eos_id is not None and not tok.adds_bos
    no_bos = build_hf_tokenizer(tmp_path / "nobos", {"eos_token": "</s>", "bos_token": None})
    tok = load_tokenizer("huggingface", str(no_bos))
    assert tok.bos_id is None and tok.pad_id == tok.eos_id  # pad falls back to EOS
    # add_bos_token in the config does not override tokenizer.json (as in transformers >= 5);
    # a contradiction is logged.
    on = build_hf_tokenizer(
        tmp_path / "on", {"eos_token": "</s>", "bos_token": "<s>", "add_bos_token": True}
    )
    with caplog.at_level(logging.WARNING):
        assert not load_tokenizer("huggingface", str(on)).adds_bos
    assert "add_bos_token is True, but the post-processor of tokenizer.json does not add it" in (
        caplog.text
    )
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


def test_whole_text_is_tokenised_and_the_completion_starts_at_the_common_prefix(hf_dir):
    tok = load_tokenizer("huggingface", str(hf_dir))
    # A space-separated completion: the prompt's ids are a prefix of the whole text's.
    prompt_ids, completion_ids = encode(tok, "hello world", " again")
    assert prompt_ids == tok.encode("hello world", add_special_tokens=True)
    assert prompt_ids + completion_ids == tok.encode("hello world again</s>", True)
    assert completion_ids[-1] == tok.eos_id and completion_ids.count(tok.eos_id) == 1
    # Tokens merging across the seam: the sequence is still the whole text's tokenisation (as
    # TRL trains on), and the prompt keeps only the ids it shares with it.
    rendered = render_example(tok, "hello wor", ["ld again"], WHERE, ["completion"])
    (encoded,) = encode_rendered(tok, [rendered])
    whole = tok.encode("hello world again</s>", True)
    assert encoded.prompt_ids + encoded.completion_ids[0] == whole and encoded.merged
    alone = tok.encode("hello wor", True)
    assert encoded.prompt_ids == alone[: len(encoded.prompt_ids)] != alone


def test_sentencepiece_bos_and_eos_added_once(sp):
    prompt_ids, completion_ids = encode(sp, "Name two fruit words .", " apple , plum .")
    assert prompt_ids == [sp.bos_id, *sp.encode("Name two fruit words .")]
    assert completion_ids == [*sp.encode(" apple , plum ."), sp.eos_id]
    # A completion that already ends with the EOS string does not get a second one (TRL).
    assert encode(sp, "Name two fruit words .", " apple , plum .</s>") == (
        prompt_ids,
        completion_ids,
    )


def test_conversational_rows_are_what_the_template_renders(hf_dir):
    tok = load_tokenizer("huggingface", str(hf_dir))
    prompt = [{"role": "user", "content": "hello"}]
    completion = [{"role": "assistant", "content": "world"}]
    rendered = render_example(tok, prompt, [completion], WHERE, ["completion"])
    assert rendered.chat
    assert rendered.prompt == "<s><|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert rendered.fulls == (rendered.prompt + "world<|im_end|>\n",)
    prompt_ids, completion_ids = encode(tok, prompt, completion)
    assert prompt_ids.count(tok.bos_id) == 1 and prompt_ids[0] == tok.bos_id  # template's BOS
    # The template's end of turn ends the completion; no EOS is appended after it.
    assert tok.decode(completion_ids) == "world<|im_end|>\n" and tok.eos_id not in completion_ids
    assert prompt_ids + completion_ids == tok.encode(rendered.fulls[0])


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


def test_template_rendering_the_prompt_differently_keeps_the_common_prefix(hf_dir, tmp_path):
    from megatron_kto.data.dataset import build_kto_dataset

    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: (thinking)\n{% endif %}"
    )
    tok = load_tokenizer("huggingface", str(hf_dir), chat_template=template)
    row = {
        "prompt": [{"role": "user", "content": "hello"}],
        "completion": [{"role": "assistant", "content": "world"}],
        "label": True,
    }
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(row) + "\n")
    dataset, stats = build_kto_dataset(path, tok, None, use_cache=False)
    whole = tok.encode("user: hello\nassistant: world\n")
    assert dataset[0]["prompt_ids"] + dataset[0]["completion_ids"] == whole
    assert stats.prompts_merged == 1 and "WARNING: 1 examples: the tokenised prompt" in (
        stats.summary()
    )


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
    assert tok.decode(item["completion_ids"]) == "world<|im_end|>\n"


def test_fingerprint_tracks_the_encoding_rule(hf_dir, monkeypatch):
    """Caches built under an older rule for special tokens are not reused (the cache key holds
    the fingerprint)."""
    import megatron_kto.data.tokenizers as tokenizers

    before = [load_tokenizer(lib, path).fingerprint for lib, path in
              (("sentencepiece", SP_MODEL), ("huggingface", str(hf_dir)))]  # fmt: skip
    monkeypatch.setattr(tokenizers, "ENCODING_RULE", "another rule")
    after = [load_tokenizer(lib, path).fingerprint for lib, path in
             (("sentencepiece", SP_MODEL), ("huggingface", str(hf_dir)))]  # fmt: skip
    assert before[0] != after[0] and before[1] != after[1]
