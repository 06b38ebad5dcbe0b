"""`tierlm.tokenizer`: round trips, ChatML rendering and its errors, generation defaults, streaming text."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tierlm.demo_model import CHATML_TEMPLATE, SPECIAL_TOKENS, train_tokenizer
from tierlm.tokenizer import (
    ChatTemplateError,
    GenerationDefaults,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
)

UNICODE_TEXT = "héllo 世界 🎉\n\tdef naïve(x):  # ünïcödé ∑ × ≠ \u00a0«»\n        return x ** 2\r\n"
ENDOFTEXT, IM_START, IM_END = 0, 1, 2  # the trainer puts the special tokens first


def _write_folder(
    folder: Path,
    *,
    tokenizer_config: dict | None = None,
    config: dict | None = None,
    generation: dict | None = None,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(train_tokenizer(1024, 300_000))
    for name, value in (
        ("tokenizer_config.json", tokenizer_config),
        ("config.json", config),
        ("generation_config.json", generation),
    ):
        if value is not None:
            (folder / name).write_text(json.dumps(value))
    return folder


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    return _write_folder(
        tmp_path_factory.mktemp("chat"),
        tokenizer_config={
            "chat_template": CHATML_TEMPLATE,
            "eos_token": "<|im_end|>",
            "pad_token": {"content": "<|endoftext|>", "special": True},
            "bos_token": None,
        },
        config={"eos_token_id": [5, IM_END]},
        generation={
            "eos_token_id": IM_START,
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 40,
            "max_new_tokens": 128,
            "repetition_penalty": 1.05,
            "do_sample": True,
        },
    )


@pytest.fixture(scope="module")
def tok(chat_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(chat_dir)


# ---- vocabulary and round trips ---------------------------------------------------------------------


def test_round_trip_unicode(tok):
    ids = tok.encode(UNICODE_TEXT)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == UNICODE_TEXT
    assert tok.vocab_size == 1024


def test_special_tokens(tok):
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [ENDOFTEXT, IM_START, IM_END]
    assert tok.eos_token_id == IM_END and tok.pad_token_id == ENDOFTEXT and tok.bos_token_id is None
    assert tok.special_token_ids == {ENDOFTEXT, IM_START, IM_END}
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == IM_START and ids[-1] == IM_END
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_unknown_special_token_is_refused(tmp_path):
    _write_folder(tmp_path, tokenizer_config={"eos_token": "</s>"})
    with pytest.raises(TokenizerError, match="eos_token"):
        Tokenizer.from_pretrained(tmp_path)


# ---- chat template ----------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi, wörld 🎉"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Again?"},
]


def test_chatml_two_turns(tok):
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi, wörld 🎉<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nAgain?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(CONVERSATION) == expected
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) == expected.removesuffix(
        "<|im_start|>assistant\n"
    )
    ids = tok.encode(expected, add_special_tokens=False)
    assert ids.count(IM_START) == 5 and ids.count(IM_END) == 4


def test_chat_content_parts(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts, add_generation_prompt=False) == "<|im_start|>user\nab<|im_end|>\n"


def test_missing_chat_template(tmp_path):
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path, tokenizer_config={"eos_token": "<|im_end|>"}))
    with pytest.raises(ChatTemplateError, match="chat template") as info:
        tok.apply_chat_template(CONVERSATION)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "list of messages"),
        ([], "empty"),
        (["hello"], r"messages\[0\]"),
        ([{"content": "no role"}], r"messages\[0\]: 'role'"),
        ([{"role": "user", "content": "ok"}, {"role": "user", "content": 3}], r"messages\[1\]: 'content'"),
        ([{"role": "user"}], r"messages\[0\]: 'content' is missing"),
        ([{"role": "user", "content": ["text"]}], r"messages\[0\]"),
        (
            [{"role": "robot", "content": "x"}],
            "Only system, user, assistant and tool",
        ),  # the template's raise_exception
    ],
)
def test_malformed_messages(tok, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(messages)


def test_template_file_wins_and_sees_special_tokens(tmp_path):
    folder = _write_folder(
        tmp_path,
        tokenizer_config={"chat_template": "unused", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    )
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}={{ m.content | tojson }}{% endfor %}\n"
        "{% generation %}{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}{% endgeneration %}"
        "{% if tools is none %}|no tools{% endif %}|{{ add_generation_prompt }}|{{ flavour }}"
    )
    tok = Tokenizer.from_pretrained(folder)
    rendered = tok.apply_chat_template([{"role": "user", "content": "<b>&"}], template_kwargs={"flavour": "x"})
    assert rendered == 'user="<b>&"<|im_end|>|<|endoftext|>|False|no tools|True|x'


def test_template_syntax_error(tmp_path):
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path, tokenizer_config={"chat_template": "{% if %}"}))
    with pytest.raises(ChatTemplateError, match="syntax error"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_is_sandboxed(tmp_path):
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path, tokenizer_config={"chat_template": template}))
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# ---- generation defaults and EOS ---------------------------------------------------------------------


def test_generation_defaults_and_eos_union(tok):
    assert tok.generation_defaults == GenerationDefaults(
        temperature=0.6, top_p=0.95, top_k=40, max_new_tokens=128, repetition_penalty=1.05
    )
    # config.json [5, im_end], then generation_config im_start, then the tokenizer's eos (already present)
    assert tok.eos_token_ids == (5, IM_END, IM_START)


def test_generation_defaults_absent(tmp_path):
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path, config={"eos_token_id": 7}))
    assert tok.generation_defaults == GenerationDefaults()
    assert tok.eos_token_ids == (7,)
    assert GenerationDefaults.from_pretrained(tmp_path) == GenerationDefaults()
    tok = Tokenizer.from_pretrained(
        _write_folder(tmp_path / "g", generation={"eos_token_id": [3, 4], "top_k": 5})
    )
    assert tok.eos_token_ids == (3, 4) and tok.generation_defaults.top_k == 5
    assert tok.generation_defaults.temperature is None


def test_bad_eos_field(tmp_path):
    with pytest.raises(TokenizerError, match="eos_token_id"):
        Tokenizer.from_pretrained(_write_folder(tmp_path, config={"eos_token_id": "x"}))


# ---- incremental detokenization ----------------------------------------------------------------------


def _byte_token_ids(tok: Tokenizer) -> list[int]:
    """The id of each single-byte token, indexed by byte value (GPT-2's byte-to-character mapping)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [tok.token_to_id(chars[b]) for b in range(256)]


def _stream(tok: Tokenizer, ids: list[int], **kwargs) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces = [detok.push(i) for i in ids]
    return pieces, detok.flush()


def test_streaming_splits_multibyte_characters_cleanly(tok):
    byte_ids = _byte_token_ids(tok)
    text = "héllo 世界 🎉!"
    ids = [byte_ids[b] for b in text.encode("utf-8")]  # every character split into its bytes
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == text and tail == ""
    assert [p for p in pieces if p] == list(text)  # each character once, whole, when its last byte arrives
    assert "\ufffd" not in "".join(pieces)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streaming_equals_full_decode_on_random_ids(tok, skip_special_tokens):
    rng = random.Random(1234)
    byte_ids = _byte_token_ids(tok)
    multibyte = [byte_ids[b] for b in "é世界🎉".encode()]
    for trial in range(200):
        n = rng.randint(1, 40)
        pool = rng.choice(["any", "bytes", "mixed"])
        if pool == "any":
            ids = [rng.randrange(tok.vocab_size) for _ in range(n)]
        elif pool == "bytes":  # high bytes: many incomplete and invalid sequences
            ids = [byte_ids[rng.randrange(0x80, 0x100)] for _ in range(n)]
        else:
            ids = [rng.choice(multibyte + [ENDOFTEXT, IM_END] + tok.encode(" ok x")) for _ in range(n)]
        pieces, tail = _stream(tok, ids, skip_special_tokens=skip_special_tokens)
        full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) + tail == full, (trial, ids)
        assert not any(p.endswith("\ufffd") for p in pieces), (trial, ids)


def test_streaming_with_prompt_context(tok):
    prompt = tok.encode("print('héllo')\n", add_special_tokens=False)
    generated = tok.encode("x = '世界 🎉'", add_special_tokens=False)
    detok = tok.detokenizer(prompt_ids=prompt)
    streamed = "".join(detok.push(i) for i in generated) + detok.flush()
    assert streamed == tok.decode(prompt + generated)[len(tok.decode(prompt)) :]
    assert detok.text == streamed


def test_encode_within_lists_ids_only_up_to_the_limit(tok):
    ids = tok.encode("def f(x): return x + 1")
    assert tok.encode_within("def f(x): return x + 1", len(ids)) == (ids, len(ids))
    assert tok.encode_within("def f(x): return x + 1", len(ids) - 1) == (None, len(ids))
