"""Text in and out of a model folder: the tokenizer, the chat template, generation defaults, streaming text.

Owns reading `tokenizer.json` (through the `tokenizers` package), `tokenizer_config.json`,
`chat_template.jinja` and `generation_config.json`; rendering chat prompts the way transformers does
(sandboxed jinja2, `trim_blocks`/`lstrip_blocks`, `raise_exception`, special tokens as variables); the set
of token ids that end a generation; and turning a stream of generated ids into stable text pieces.
It does not own sampling (the engine reads `GenerationDefaults`) nor the OpenAI message schema (the server
validates requests; this module only checks what the template needs).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

# The special-token roles transformers passes to a chat template as variables (as strings).
SPECIAL_TOKEN_ROLES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)
_REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """A model folder whose tokenizer files tierlm cannot use; the message names the file and the problem."""


class ChatTemplateError(TokenizerError):
    """No chat template, a template that fails to compile or render, or a message the template cannot take."""


# ---- generation_config.json -------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults a model folder ships in `generation_config.json` (None where it says nothing)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> GenerationDefaults:
        def pick(key: str, kind: type) -> Any:
            value = raw.get(key)
            return None if value is None else kind(value)

        return cls(
            temperature=pick("temperature", float),
            top_p=pick("top_p", float),
            top_k=pick("top_k", int),
            max_new_tokens=pick("max_new_tokens", int),
            repetition_penalty=pick("repetition_penalty", float),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> GenerationDefaults:
        return cls.from_dict(_read_json(Path(model_dir) / "generation_config.json", missing_ok=True))


def _read_json(path: Path, *, missing_ok: bool) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise TokenizerError(f"{path.name}: not found in {path.parent}") from None
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path.name}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise TokenizerError(f"{path.name}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _as_id_list(value: Any, source: str) -> list[int]:
    """An `eos_token_id` field (absent, an int or a list of ints) as a list."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizerError(f"{source}: eos_token_id must be an int or a list of ints, got {value!r}")
    return list(values)


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


# ---- chat template ----------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (assistant-mask markers) and render the body as is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
):
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses (sandboxed, trimmed blocks)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template: syntax error on line {exc.lineno}: {exc.message}") from None


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """The checks every chat template relies on; the server's request schema is stricter."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages: expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages: the conversation is empty")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(
                f"messages[{i}]: expected a mapping with 'role' and 'content', got {message!r}"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}]: 'role' must be a non-empty string, got {role!r}")
        content = message.get("content")
        if content is None and role != "assistant":
            raise ChatTemplateError(
                f"messages[{i}]: 'content' is missing (only an assistant turn may omit it)"
            )
        if content is not None and not isinstance(content, (str, list)):
            raise ChatTemplateError(
                f"messages[{i}]: 'content' must be a string or a list of parts, got {type(content).__name__}"
            )
        if isinstance(content, list) and not all(isinstance(part, Mapping) for part in content):
            raise ChatTemplateError(f"messages[{i}]: every part of a list 'content' must be a mapping")
        checked.append(dict(message))
    return checked


# ---- the tokenizer ----------------------------------------------------------------------------------


class Tokenizer:
    """A model folder's tokenizer: ids from text and back, chat prompts, and the ids that end a generation."""

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        chat_template: str | dict[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        generation_defaults: GenerationDefaults | None = None,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.generation_defaults = generation_defaults or GenerationDefaults()
        for role, token in self.special_tokens.items():
            if backend.token_to_id(token) is None:
                raise TokenizerError(f"tokenizer_config.json: {role} {token!r} is not in the vocabulary")
        eos = list(extra_eos_token_ids)
        if self.eos_token_id is not None:
            eos.append(self.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Read tokenizer.json and, where present, tokenizer_config.json, chat_template.jinja, config.json and
        generation_config.json (the last two for the EOS set and sampling defaults)."""
        folder = Path(model_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"tokenizer.json: not found in {folder}")
        try:
            backend = _BackendTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 (the Rust side raises a bare Exception)
            raise TokenizerError(f"tokenizer.json: cannot be read ({exc})") from None

        tok_config = _read_json(folder / "tokenizer_config.json", missing_ok=True)
        legacy_map = _read_json(folder / "special_tokens_map.json", missing_ok=True)
        special = {}
        for role in SPECIAL_TOKEN_ROLES:
            token = _token_content(tok_config.get(role, legacy_map.get(role)))
            if token is not None:
                special[role] = token

        chat_template: str | dict[str, str] | None = tok_config.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
            chat_template = {entry["name"]: entry["template"] for entry in chat_template}
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():  # the standalone file wins, as in transformers
            default = template_file.read_text(encoding="utf-8")
            chat_template = (
                {**chat_template, "default": default} if isinstance(chat_template, dict) else default
            )

        model_config = _read_json(folder / "config.json", missing_ok=True)
        text_config = model_config.get("text_config") or {}
        generation = _read_json(folder / "generation_config.json", missing_ok=True)
        eos = _as_id_list(model_config.get("eos_token_id", text_config.get("eos_token_id")), "config.json")
        eos += _as_id_list(generation.get("eos_token_id"), "generation_config.json")
        return cls(
            backend,
            chat_template=chat_template,
            special_tokens=special,
            extra_eos_token_ids=eos,
            generation_defaults=GenerationDefaults.from_dict(generation),
        )

    # ---- vocabulary ---------------------------------------------------------------------------------
    @cached_property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding may be padded beyond it)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _special_id(self, role: str) -> int | None:
        token = self.special_tokens.get(role)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own EOS token; `eos_token_ids` is the full stop set."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of every added token marked special (what `skip_special_tokens` drops)."""
        decoder = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, token in decoder.items() if token.special)

    # ---- text <-> ids -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`; special tokens written in the text are recognised.

        `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS), as transformers does by
        default; pass False for a rendered chat prompt, which already holds its special tokens.
        """
        return self._encoding(text, add_special_tokens).ids

    def encode_within(self, text: str, limit: int, add_special_tokens: bool = True) -> tuple[list[int] | None, int]:
        """(ids, count) of `text`, or (None, count) when it has more than `limit` tokens: the ids of a text
        too long to use are never made into a Python list (millions of ints for a huge prompt)."""
        encoding = self._encoding(text, add_special_tokens)
        return (encoding.ids if len(encoding) <= limit else None), len(encoding)

    def _encoding(self, text: str, add_special_tokens: bool):
        # encode_batch releases the GIL while it works (encode holds it: a 1 MB prompt would stall every
        # other thread, the server's event loop included, for a second or more)
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat ---------------------------------------------------------------------------------------
    def _template_source(self, tools: Any) -> tuple[str, str]:
        template = self.chat_template
        if template is None:
            raise ChatTemplateError(
                "chat template: this model has none (no 'chat_template' in tokenizer_config.json and no "
                "chat_template.jinja); send a plain completion prompt instead"
            )
        if isinstance(template, str):
            return "default", template
        name = "tool_use" if tools is not None and "tool_use" in template else "default"
        if name not in template:
            raise ChatTemplateError(
                f"chat template: no 'default' among the named templates {sorted(template)}"
            )
        return name, template[name]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for a conversation (encode it with `add_special_tokens=False`).

        Variables as transformers provides them: `messages`, `add_generation_prompt`, `tools`, the special
        tokens as strings (`bos_token`, `eos_token`, ...), and any `template_kwargs` (`enable_thinking`, ...).
        """
        checked = _check_messages(messages)
        template_kwargs = dict(template_kwargs or {})
        reserved = sorted({"messages", "add_generation_prompt", "tools"} & set(template_kwargs))
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set there")
        name, source = self._template_source(tools)
        if name not in self._compiled:
            self._compiled[name] = compile_chat_template(source)
        variables = {**self.special_tokens, **template_kwargs}
        try:
            return self._compiled[name].render(
                messages=checked, add_generation_prompt=add_generation_prompt, tools=tools, **variables
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, ArithmeticError) as exc:
            # the template tripped on a value it was given (a message field, a template kwarg)
            raise ChatTemplateError(f"chat template failed on the values given: {type(exc).__name__}: {exc}") from None

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)


# ---- streaming text -------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns generated ids, one at a time, into text pieces that never change once emitted.

    Each `push` decodes a short window of recent ids twice (without and with the ids not yet emitted) and
    emits the difference once it is stable: longer than before and not ending in U+FFFD (a multi-byte
    character still split across tokens). Decoding a window rather than single ids keeps the decoder's
    context (leading-space rules, byte fallback). `flush` emits whatever is held back at the end, so
    `"".join(pieces) + flush()` equals `tokenizer.decode(generated_ids)`.

    `prompt_ids` give the first generated id its left context; their text is never emitted.
    """

    PROMPT_CONTEXT = 6  # prompt ids kept as left context

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self.PROMPT_CONTEXT :]) if prompt_ids else []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # ids before this are emitted (or are prompt context)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def _window_texts(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        window = self._ids[self._prefix_offset :]
        emitted_part = decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip
        )
        return emitted_part, decode(window, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the newly completed text ('' while a character is incomplete)."""
        self._ids.append(int(token_id))
        before, after = self._window_texts()
        if len(after) <= len(before) or after.endswith(_REPLACEMENT_CHAR) or not after.startswith(before):
            return ""
        piece = after[len(before) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        """Emit the held-back tail (e.g. a trailing U+FFFD for bytes the generation left incomplete)."""
        if self._read_offset == len(self._ids):
            return ""
        before, after = self._window_texts()
        piece = after[len(before) :] if after.startswith(before) else ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if piece:
            self._pieces.append(piece)
        return piece
