"""Tool calls in each model's own format (agents/chat.py): for every family of tests/models/families.py (their
templates have no tools: the Hermes fallback), SmolLM2's ChatML, and the tool templates TRL ships (Qwen2.5, Qwen3's
prefix-preserving training template, Llama 3.1; native, parsed by the Hermes parser or by transformers'
parse_response with TRL's response templates): render, "generate" (the model's pieces, as a model would write them),
parse, render again gives the same ids; the ids an episode gathers turn by turn are the rendered ids; the mask
covers the assistant's own tokens only. Malformed answers are errors, never exceptions."""

from __future__ import annotations

import copy

import pytest

from tests.models.families import FAMILIES, family_tokenizer
from tpu_helpers.agents import ChatFormat, Toolbox, tool_schema
from tpu_helpers.agents.chat import parse_hermes
from tpu_helpers.core.choices import ConfigError

ctu = pytest.importorskip("trl.chat_template_utils")


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


SCHEMAS = [tool_schema(multiply)]


def call(a, b):
    return {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}


def conversation(calls_per_turn: int = 2, say: str = "Let me check.") -> list[dict]:
    calls = [call(3, 4), call(1, 2)][:calls_per_turn]
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 times 4?"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            *[{"role": "tool", "name": "multiply", "content": r} for r in ("12", "2")[:calls_per_turn]],
            {"role": "assistant", "content": say, "tool_calls": [call(4, 3)]},
            {"role": "tool", "name": "multiply", "content": "12"},
            {"role": "assistant", "content": "It is 12."}]


def round_trip(fmt: ChatFormat, messages: list[dict]) -> None:
    """Play the conversation as an episode: prompt ids, the model's piece as its generation, parse, continue."""
    rendered = fmt.render(messages, SCHEMAS)
    conv = [m for m in messages[:2]]
    ids = fmt.prompt_ids(conv, SCHEMAS)
    box = Toolbox([multiply])
    for m in messages[2:]:
        if m["role"] != "assistant":
            continue
        own = [text for text, mine in fmt.pieces([*conv, m], SCHEMAS) if mine][-1]
        generated = fmt._ids(own)
        parsed = fmt.parse(generated, prefix=ids, tools=SCHEMAS)
        assert parsed.errors == [] and parsed.message.get("tool_calls") == m.get("tool_calls"), parsed
        ids += generated
        conv.append(parsed.message)
        replies = box.run(parsed.message.get("tool_calls"), parsed.errors)
        if replies:
            conv += replies
            ids += fmt.continuation_ids(conv, SCHEMAS)
    assert conv == [{**m, "content": m["content"]} for m in messages]  # parsed back as written
    again = fmt.render(conv, SCHEMAS)
    assert again.ids == rendered.ids
    assert ids == rendered.ids[:len(ids)] and len(rendered.ids) - len(ids) <= 2  # the template's closing text
    model_text = fmt.tokenizer.decode([t for t, k in zip(rendered.ids, rendered.mask, strict=True) if k])
    assert "It is 12." in model_text and ('<tool_call>' in model_text or '"name": "multiply"' in model_text)
    assert "Be brief" not in model_text and "What is 3" not in model_text and "<tool_response>" not in model_text


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "qwen3"])
def test_each_family_template_round_trips_through_the_hermes_fallback(name, tiny_lm_dir):
    fmt = ChatFormat(family_tokenizer(name, tiny_lm_dir))
    assert not fmt.native and fmt.parser == "hermes"
    round_trip(fmt, conversation())
    text = "".join(t for t, _ in fmt.pieces(conversation(), SCHEMAS))
    assert '<tools>\n{"type": "function", "function": {"name": "multiply"' in text
    assert "<tool_response>\n12\n</tool_response>\n<tool_response>\n2\n</tool_response>" in text


def test_qwen3_test_template_is_refused_as_not_prefix_preserving(tiny_lm_dir):
    # Its last answer alone opens with a think block: an earlier turn's text changes once a later one follows.
    fmt = ChatFormat(family_tokenizer("qwen3", tiny_lm_dir))
    with pytest.raises(ConfigError, match=r"the chat template is not prefix-preserving: rendering up to message 5 "
                                          r"rewrites earlier text .*trl/chat_templates/\*_training.jinja"):
        fmt.render(conversation(), SCHEMAS)


def test_the_tiny_qwen2_and_smollm2_templates_use_the_fallback(tiny_lm_dir):
    from transformers import AutoTokenizer

    from tpu_helpers.models import smollm2

    fmt = ChatFormat(AutoTokenizer.from_pretrained(tiny_lm_dir))
    assert not fmt.native and fmt.end == "<|im_end|>"
    round_trip(fmt, conversation())
    target = smollm2.default_cache_dir() / smollm2.DIR_NAME
    if not smollm2.is_complete(target):
        pytest.skip("SmolLM2 is not built in the package cache (models/smollm2.py)")
    fmt = ChatFormat(AutoTokenizer.from_pretrained(target))
    assert not fmt.native and fmt.parser == "hermes"
    round_trip(fmt, conversation())


@pytest.mark.parametrize("family, template, response, calls", [
    ("qwen2", "qwen2_5.jinja", None, 2),
    ("qwen2", "qwen2_5.jinja", "qwen3_template", 2),
    ("qwen3", "qwen3_training.jinja", "qwen3_template", 2),
    # Llama 3.1's template takes one call per message, and writes a call's JSON without the message's text
    ("llama3", "llama3_1.jinja", "llama3_template", 1),
], ids=["qwen2.5-hermes", "qwen2.5-parse_response", "qwen3-parse_response", "llama3.1-parse_response"])
def test_native_tool_templates_round_trip(family, template, response, calls, tiny_lm_dir):
    tok = family_tokenizer(family, tiny_lm_dir)
    tok.chat_template = (ctu._CHAT_TEMPLATES_DIR / template).read_text()
    if response:
        tok.response_template = getattr(ctu, response)
    fmt = ChatFormat(tok)
    assert fmt.native and fmt.parser == ("response_template" if response else "hermes")
    messages = conversation(calls, say="" if family == "llama3" else "Let me check.")
    # Our schemas render as the callables TRL passes in tools= do.
    assert "".join(t for t, _ in fmt.pieces(messages, SCHEMAS)) == tok.apply_chat_template(
        messages, tools=[multiply], tokenize=False)
    round_trip(fmt, messages)


def test_a_native_template_without_a_parser_is_refused(tiny_lm_dir):
    tok = family_tokenizer("llama3", tiny_lm_dir)
    tok.chat_template = ctu.llama3_1_chat_template
    with pytest.raises(ConfigError, match=r"renders tool calls in its own format and the tokenizer has no "
                                          r"response_template"):
        ChatFormat(tok)


def test_the_hermes_parser_takes_several_calls_and_reports_malformed_ones():
    text = ('Sure.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "multiply", "arguments": {"a": 1,}}\n</tool_call>\n'
            '<tool_call>\n{"name": "divide", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name"')
    parsed = parse_hermes(text)
    assert [c["function"]["name"] for c in parsed.message["tool_calls"]] == ["multiply", "divide"]
    assert len(parsed.errors) == 2 and parsed.errors[0].startswith("malformed tool call '{\"name\": \"multiply\", "
                                                                   "\"arguments\": {\"a\": 1,}}': Expecting")
    assert parsed.errors[1].startswith("unclosed tool call '<tool_call>\\n{\"name\"'")
    assert parsed.message["content"].startswith("Sure.\n") and '{"a": 1,}' in parsed.message["content"]
    box = Toolbox([multiply])
    replies = box.run(parsed.message["tool_calls"], parsed.errors)
    assert [r["content"] for r in replies][:2] == ["2", "{'error': 'Tool divide not found.'}"]
    assert box.stats.calls == 4 and dict(box.stats.failures) == {"unknown_tool": 1, "malformed": 2}


def test_a_malformed_answer_under_parse_response_is_an_error_not_an_exception(tiny_lm_dir):
    tok = family_tokenizer("qwen3", tiny_lm_dir)
    tok.chat_template = (ctu._CHAT_TEMPLATES_DIR / "qwen3_training.jinja").read_text()
    tok.response_template = ctu.qwen3_template
    fmt = ChatFormat(tok)
    prefix = fmt.prompt_ids(conversation()[:2], SCHEMAS)
    parsed = fmt.parse(fmt._ids('<tool_call>\n{"name": "multiply", "arguments": {"a": }\n</tool_call><|im_end|>'),
                       prefix=prefix, tools=SCHEMAS)
    assert parsed.message["role"] == "assistant" and "tool_calls" not in parsed.message
    assert len(parsed.errors) == 1 and parsed.errors[0].startswith("malformed tool call")
    assert copy.deepcopy(parsed.message)["content"].startswith("<tool_call>")
