"""Tool-call and reasoning parsers on text alone: calls and content read out of each format, streamed
pieces (any split) joining to the whole answer, and the structural tags that force a call accepting
exactly that format (checked with xgrammar's matcher on the demo tokenizer)."""

from __future__ import annotations

import json
import random

import pytest

from tierlm.server.reasoning_parser import Qwen3ReasoningParser
from tierlm.server.tool_parsers import TOOL_PARSERS

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array", "items": {"type": "integer"}}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "hours": [1, 2]}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
QWEN3_CODER = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
               "<parameter=hours>\n[1, 2]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
               "</function>\n</tool_call>")
EXPECTED = {
    "hermes": [("get_weather", {"city": "Paris", "hours": [1, 2]}), ("get_time", {})],
    "qwen3_coder": [("get_weather", {"city": "Paris", "days": 3, "metric": True, "hours": [1, 2]}),
                    ("get_time", {})],
}
TEXTS = {"hermes": HERMES, "qwen3_coder": QWEN3_CODER}


def run(parser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    """Feed the pieces; (content, [(name, arguments)], every delta) as a client would join them."""
    content, calls, deltas = "", {}, []
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        deltas.append(delta)
        content += delta.content
        for call in delta.tool_calls:
            if call.name is not None:
                assert call.index == len(calls) and call.arguments == ""  # a call opens with its name alone
                calls[call.index] = [call.name, ""]
            calls[call.index][1] += call.arguments
    return content, [tuple(c) for c in calls.values()], deltas


def splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(30, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_calls_and_content_whole_and_streamed(name):
    text = TEXTS[name]
    whole = run(TOOL_PARSERS[name](TOOLS), [text])
    assert whole[0] == "Let me check.\n"
    assert [(n, json.loads(a)) for n, a in whole[1]] == EXPECTED[name]
    for seed in range(20):
        assert run(TOOL_PARSERS[name](TOOLS), splits(text, seed))[:2] == whole[:2]
    by_char = run(TOOL_PARSERS[name](TOOLS), list(text))
    assert by_char[:2] == whole[:2]
    fragments = [c for d in by_char[2] for c in d.tool_calls if c.arguments]
    assert len(fragments) > 2  # the arguments arrived in pieces, not at the end


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_text_that_only_looks_like_a_tag_is_content(name):
    for text in ("a < b and <tool_ but no call", "x <tool_call> not a call </tool_call> y"):
        content, calls, _ = run(TOOL_PARSERS[name](TOOLS), list(text))
        assert (content, calls) == (text, [])


def test_hermes_reads_other_key_orders_at_the_end_and_cut_calls_at_finish():
    parser = TOOL_PARSERS["hermes"](TOOLS)
    content, calls, _ = run(parser, ['<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>'])
    assert content == "" and calls == [("get_weather", '{"city": "Rome"}')]
    content, calls, _ = run(TOOL_PARSERS["hermes"](TOOLS), ['<tool_call>\n{"name": "get_weather", "arguments": {"ci'])
    assert calls == [("get_weather", '{"ci')]  # cut by max_tokens: what was written


def test_hermes_streams_nested_arguments_without_the_closing_brace():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"where": {"city": "Oslo"}, "days": [1]}}\n</tool_call>'
    content, calls, _ = run(TOOL_PARSERS["hermes"](TOOLS), list(text))
    assert content == "" and calls == [("get_weather", '{"where": {"city": "Oslo"}, "days": [1]}')]


def test_qwen3_coder_keeps_values_that_do_not_fit_their_type_as_text():
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\nsoon\n</parameter>\n</function>\n</tool_call>"
    _, calls, _ = run(TOOL_PARSERS["qwen3_coder"](TOOLS), [text])
    assert calls == [("get_weather", '{"days": "soon"}')]


def split_reasoning(prompt: str | None, pieces: list[str]) -> tuple[str, str]:
    parser = Qwen3ReasoningParser(prompt)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@pytest.mark.parametrize(("prompt", "output", "expected"), [
    ("<|im_start|>assistant\n", "<think>\nhmm\n</think>\n\nThe answer.", ("\nhmm\n", "The answer.")),
    ("<|im_start|>assistant\n<think>\n", "hmm</think>The answer.", ("hmm", "The answer.")),
    ("<|im_start|>assistant\n", "No thinking </think> here.", ("", "No thinking </think> here.")),
    ("<|im_start|>assistant\n<think>\n", "cut off while thinking </thi", ("cut off while thinking </thi", "")),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "<thinking aloud", ("", "<thinking aloud")),
])
def test_reasoning_split_whole_and_streamed(prompt, output, expected):
    assert split_reasoning(prompt, [output]) == expected
    assert split_reasoning(prompt, list(output)) == expected
    for seed in range(10):
        assert split_reasoning(prompt, splits(output, seed)) == expected


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    from tierlm.demo_model import build_demo_model
    from tierlm.engine.structured_output import StructuredOutputManager
    from tierlm.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny"))
    return StructuredOutputManager(tokenizer, tokenizer.vocab_size, list(tokenizer.eos_token_ids))


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("parallel", [False, True])
def test_structural_tag_accepts_the_format_and_nothing_else(name, parallel, manager):
    import xgrammar

    compiled = manager._compile("structural_tag", TOOL_PARSERS[name].structural_tag(TOOLS, parallel))
    calls = TEXTS[name].removeprefix("Let me check.\n")
    one_call = calls[: calls.index("</tool_call>") + len("</tool_call>")]

    def accepts(text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts(one_call)
    assert accepts(calls) == parallel
    assert not accepts("Let me check.\n" + one_call)  # no free text
    assert not accepts(one_call.replace("get_weather", "get_wether"))  # only the tools given
    assert not accepts("")  # at least one call


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_max_calls_keeps_the_first_call_and_drops_later_blocks_whole(name):
    """parallel_tool_calls: false under "auto": the second call is neither a call nor content, at any split."""
    text = TEXTS[name] + "\nDone."
    first_name, first_arguments = EXPECTED[name][0]
    for pieces in [[text], list(text), *(splits(text, seed) for seed in range(10))]:
        content, calls, _ = run(TOOL_PARSERS[name](TOOLS, max_calls=1), pieces)
        assert content == "Let me check.\nDone."
        [(call_name, arguments)] = calls
        assert call_name == first_name and json.loads(arguments) == first_arguments
    # a second block left open at the end is dropped too
    open_second = TEXTS[name][: TEXTS[name].rindex("</tool_call>")]
    content, calls, _ = run(TOOL_PARSERS[name](TOOLS, max_calls=1), [open_second])
    assert content == "Let me check.\n" and len(calls) == 1


def test_hermes_length_bounded_strings_take_no_raw_control_character(manager):
    """The tool-call vocabulary has newline and tab tokens; a maxLength string must still be JSON."""
    import xgrammar

    note = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 1, "maxLength": 4}},
        "required": ["text"]}}}
    compiled = manager._compile("structural_tag", TOOL_PARSERS["hermes"].structural_tag([note], False))

    def accepts(value: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled)
        call = f'<tool_call>\n{{"name": "note", "arguments": {{"text": "{value}"}}}}\n</tool_call>'
        return matcher.accept_string(call) and matcher.is_completed()

    assert accepts("ab") and accepts("abcd") and accepts("é")
    assert not accepts("") and not accepts("abcde")  # the bounds hold
    assert not accepts("a\nb") and not accepts("a\tb")  # not JSON


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_an_array_without_items_holds_any_json_values(name, manager):
    import xgrammar

    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array"}}, "required": ["xs"]}}}
    compiled = manager._compile("structural_tag", TOOL_PARSERS[name].structural_tag([tool], False))
    for value in ('[1, "a", {"b": null}]', "[]"):
        call = {"hermes": f'<tool_call>\n{{"name": "f", "arguments": {{"xs": {value}}}}}\n</tool_call>',
                "qwen3_coder": f"<tool_call>\n<function=f>\n<parameter=xs>\n{value}\n</parameter>\n</function>\n"
                               "</tool_call>"}[name]
        matcher = xgrammar.GrammarMatcher(compiled)
        assert matcher.accept_string(call) and matcher.is_completed()
        [(_, arguments)] = run(TOOL_PARSERS[name]([tool]), [call])[1]
        assert json.loads(arguments) == {"xs": json.loads(value)}
