"""Grammar-constrained decoding: JSON output that parses (and matches a JSON schema), or tool calls in a
tool parser's format (an xgrammar structural tag), through xgrammar; optionally only after reasoning.

Owns the model's `xgrammar.TokenizerInfo` (built from tokenizer.json, sized to the model's vocab_size,
the engine's EOS ids as the stop tokens), schema checking (JSON syntax, then the JSON Schema
meta-schema, then what xgrammar can compile: each failure is a `ValueError` naming the problem), the
compiled grammars (cached by schema text) and each request's
`GrammarState` (the matcher, its token bitmask). It does not sample (the `Sampler` asks the state for its
token bitmask) nor decide when a request ends (`Request.append_token` advances the state and stops on termination).

Output is compact JSON (xgrammar's `any_whitespace=False`: ", " and ": " separators, no free whitespace),
so a model cannot stall in whitespace; user schemas are compiled in xgrammar's strict mode (no properties
or items beyond those the schema names), `json_object` as a non-strict `{"type": "object"}`.
Special tokens, padded ids and tokens holding a raw control character (U+0000-U+001F) are kept out of
every JSON grammar: JSON never allows such a character (strings escape it; our whitespace is spaces),
but xgrammar 0.2's rule for length-bounded strings (`maxLength`) would let one in. Structural tags (tool
calls) are compiled against a vocabulary that also has the tokens whose control characters are line
whitespace (newline, tab, carriage return: the formats' separators); so a JSON tool call's schema goes
through `bounded_strings_as_patterns` first: a length-bounded string becomes a pattern of characters that
need no escape (xgrammar's patterns never allow a control character; nor, today, any escape, so such a
string cannot hold a quote, a backslash or a newline); a qwen_xml tool call's, through `arrays_with_items`
(an array without `items` holds any values, not none). A known gap left open:
xgrammar accepts UTF-8-encoded surrogates (U+D800-U+DFFF) inside strings, which Python decodes as three
U+FFFD characters.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

import torch
import xgrammar

from tierlm.sampling_params import StructuredOutputRequest
from tierlm.tokenizer import Tokenizer

_ANY_OBJECT = '{"type": "object"}'
_CONTROL = re.compile("[\x00-\x1f]")
_LINE_WHITESPACE = {"\n", "\r", "\t"}
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[12:09:50] /project/cpp/file.cc:123: "


class InvalidSchemaError(ValueError):
    """A `json_schema` that is not JSON, not a valid JSON Schema, or not one xgrammar supports.

    Its message starts with "json_schema" (the server names `response_format` as the faulty parameter)."""


class GrammarState:
    """One request's position in its grammar: which tokens may come next, and whether it is complete.

    A request that reasons first (`StructuredOutputRequest.reasoning_end_token_id`: its prompt opened a
    reasoning block) is unconstrained until the reasoning ends (phase "open"), then constrained ("grammar").
    """

    def __init__(
        self, compiled: xgrammar.CompiledGrammar, vocab_size: int, request: StructuredOutputRequest | None = None
    ) -> None:
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self._end = request.reasoning_end_token_id if request is not None else None
        self.phase = "grammar" if self._end is None else "open"
        self._matched = 0  # tokens the matcher accepted (those after the reasoning's end): what it can roll back

    def token_bitmask(self) -> torch.Tensor | None:
        """The tokens allowed next as xgrammar's int32 bitmask row (a fresh CPU tensor: also what a pipeline's
        rank 0 sends to the last rank, which samples), or None when any token may come (reasoning is open,
        or the grammar allows everything)."""
        if self.phase == "open" or not self._matcher.fill_next_token_bitmask(self._bitmask):
            return None
        return self._bitmask[0].clone()

    def fill_token_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the tokens allowed next into bitmask[row] (a CPU int32 [rows, words] tensor, as the sampler
        batches them); False when any token may come (the row is then not a mask to apply)."""
        return self.phase != "open" and self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (the state is unchanged)."""
        if self.phase == "open":
            if token_id == self._end:
                self.phase = "grammar"
            return True
        if self.is_terminated:  # nothing follows the stop token (xgrammar would only warn)
            return False
        accepted = self._matcher.accept_token(token_id)
        self._matched += accepted
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding walks the matcher over drafts
        and steps back): a rollback past the reasoning's end token reopens the reasoning."""
        if num_tokens <= 0:
            return
        matched = min(num_tokens, self._matched)
        if matched:
            self._matcher.rollback(matched)
            self._matched -= matched
        if num_tokens > matched and self._end is not None:
            self.phase = "open"

    @property
    def is_terminated(self) -> bool:
        """The output is complete and a stop token was accepted."""
        return self.phase == "grammar" and self._matcher.is_terminated()


class BitmaskGrammar:
    """A grammar's mask for one step, sent from the process that holds the matcher (`token_bitmask`): what
    a pipeline's last rank samples with."""

    def __init__(self, bitmask: torch.Tensor | None) -> None:
        self.bitmask = bitmask

    def token_bitmask(self) -> torch.Tensor | None:
        return self.bitmask

    def fill_token_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        if self.bitmask is None:
            return False
        bitmask[row] = self.bitmask
        return True


class StructuredOutputManager:
    """Compiles structured-output requests against one model's vocabulary; one per engine."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        # byte-level / byte-fallback / raw, and add_prefix_space, read from tokenizer.json as xgrammar's
        # own `TokenizerInfo.from_huggingface` does for a fast tokenizer
        metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        tokens = {i: token for token, i in vocab.items() if i < vocab_size}
        ids = sorted(tokens)
        texts = tokenizer.backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        json_vocab = [""] * vocab_size  # "" marks an id no grammar uses
        tag_vocab = [""] * vocab_size
        for token_id, text in zip(ids, texts, strict=True):
            if token_id in tokenizer.special_token_ids:
                continue
            control = set(_CONTROL.findall(text))
            if not control:
                json_vocab[token_id] = tokens[token_id]
            if control <= _LINE_WHITESPACE:
                tag_vocab[token_id] = tokens[token_id]

        def compiler(encoded_vocab: list[str]) -> xgrammar.GrammarCompiler:
            info = xgrammar.TokenizerInfo(
                encoded_vocab, metadata["vocab_type"], vocab_size=vocab_size,
                stop_token_ids=sorted(stop_token_ids), add_prefix_space=metadata["add_prefix_space"],
            )
            return xgrammar.GrammarCompiler(info, cache_enabled=False)

        self._compiler = compiler(json_vocab)
        self._tag_compiler = compiler(tag_vocab)  # tool-call formats put newlines between their parts
        self.vocab_size = vocab_size
        # compiled grammars by StructuredOutputRequest.grammar_key; thread-safe (the server compiles off
        # the engine thread, `compile`, and the engine's `new_state` then finds the grammar here)
        self._compile = functools.lru_cache(maxsize=256)(self._compile_uncached)

    def compile(self, request: StructuredOutputRequest) -> None:
        """Compile `request`'s grammar into the cache (raises InvalidSchemaError for a bad schema)."""
        self._compile(*request.grammar_key)

    def new_state(self, request: StructuredOutputRequest) -> GrammarState:
        """A fresh matcher for `request` (raises InvalidSchemaError for a bad schema)."""
        return GrammarState(self._compile(*request.grammar_key), self.vocab_size, request)

    def _compile_uncached(self, kind: str, text: str) -> xgrammar.CompiledGrammar:
        if kind == "json_object":
            return self._compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
        if kind == "structural_tag":
            try:
                return self._tag_compiler.compile_structural_tag(text)
            except (RuntimeError, ValueError) as exc:
                raise InvalidSchemaError(f"json_schema of a tool is not supported: {_xgrammar_message(exc)}") from None
        check_json_schema(text)
        try:
            return self._compiler.compile_json_schema(text, any_whitespace=False)
        except RuntimeError as exc:
            raise InvalidSchemaError(f"json_schema is not supported: {_xgrammar_message(exc)}") from None


_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples"})  # keywords whose values are data


def _rewritten(schema: Any, rewrite: Callable[[dict[str, Any]], None]) -> Any:
    """A copy of `schema` with `rewrite` applied (in place) to each of its (sub)schema objects."""
    if isinstance(schema, list):
        return [_rewritten(item, rewrite) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _NOT_SCHEMAS else _rewritten(value, rewrite) for key, value in schema.items()}
    rewrite(out)
    return out


def _bounded_string_as_pattern(schema: dict[str, Any]) -> None:
    bounded = "minLength" in schema or "maxLength" in schema
    if schema.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & schema.keys():
        low, high = schema.pop("minLength", 0), schema.pop("maxLength", "")
        schema["pattern"] = rf'^[^"\\\x00-\x1f]{{{low},{high}}}$'


def bounded_strings_as_patterns(schema: Any) -> Any:
    """`schema` with every `{"type": "string", "minLength"/"maxLength": ...}` (and no pattern or format of
    its own) written as a `pattern` of that many characters needing no escape; the rest unchanged."""
    return _rewritten(schema, _bounded_string_as_pattern)


def _array_of_anything(schema: dict[str, Any]) -> None:
    if schema.get("type") == "array" and "items" not in schema and "prefixItems" not in schema:
        schema["items"] = {}


def arrays_with_items(schema: Any) -> Any:
    """`schema` with `"items": {}` on every array that names no items: JSON Schema's meaning (any JSON
    values), which xgrammar's qwen_xml style would otherwise read as "only the empty array"."""
    return _rewritten(schema, _array_of_anything)


def check_json_schema(text: str) -> None:
    """Raise InvalidSchemaError unless `text` is a JSON object that is a valid JSON Schema."""
    import jsonschema

    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidSchemaError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InvalidSchemaError(f"json_schema must be a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/" + "/".join(str(p) for p in exc.absolute_path)
        message = f"json_schema is not a valid JSON Schema at {where}: {exc.message}"
        raise InvalidSchemaError(message) from None


def _xgrammar_message(exc: RuntimeError) -> str:
    return _XGRAMMAR_PREFIX.sub("", str(exc).strip())
