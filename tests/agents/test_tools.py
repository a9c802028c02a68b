"""Tools at run time (agents/tools.py): each failure mode becomes the tool message's text, as TRL writes it, and is
counted by kind; a sync tool past its timeout and an async one are handled; a non-string result is its str()."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tpu_helpers.agents import Toolbox, tool_schema
from tpu_helpers.core.choices import ConfigError


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def boom(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"no luck with {x}")


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


async def async_add(a: int, b: int) -> str:
    """Add two integers, later.

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0.01)
    return str(a + b)


async def async_sleepy(seconds: float) -> str:
    """Sleeps, asynchronously.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "awake"


def call(box, name, args):
    return box.run([{"type": "function", "function": {"name": name, "arguments": args}}])[0]


@pytest.fixture
def box():
    return Toolbox([add, boom, sleepy, async_add, async_sleepy], timeout_s=0.3)


def test_a_good_call_and_a_non_string_result_converted_as_trl_does(box):
    assert call(box, "add", {"a": 2, "b": 3}) == {"role": "tool", "name": "add", "content": "5"}
    assert call(box, "async_add", {"a": 2, "b": 3})["content"] == "5"
    assert box.stats.calls == 2 and box.stats.failed == 0 and box.stats.converted == 1


@pytest.mark.parametrize("name, args, kind, text", [
    ("boom", {"x": "y"}, "raised", "{'error': 'no luck with y'}"),
    ("add", {"a": 1, "c": 2}, "wrong_args", "{'error': \"add() got an unexpected keyword argument 'c'\"}"),
    ("add", {"a": 1}, "wrong_args", "{'error': \"add() missing 1 required positional argument: 'b'\"}"),
    ("async_add", {"b": 1}, "wrong_args",
     "{'error': \"async_add() missing 1 required positional argument: 'a'\"}"),
    ("add", [1, 2], "wrong_args", "{'error': 'add() argument after ** must be a mapping, not list'}"),
    ("nope", {}, "unknown_tool", "{'error': 'Tool nope not found.'}"),
    ("sleepy", {"seconds": 5}, "timeout", "{'error': 'Tool sleepy timed out after 0.3 s'}"),
    ("async_sleepy", {"seconds": 5}, "timeout", "{'error': 'Tool async_sleepy timed out after 0.3 s'}"),
], ids=["raises", "unexpected-arg", "missing-arg", "async-missing-arg", "not-a-dict", "unknown", "hangs",
        "async-hangs"])
def test_each_failure_is_the_tool_message_text_and_counted(box, name, args, kind, text):
    t0 = time.time()
    message = call(box, name, args)
    assert message == {"role": "tool", "name": name, "content": text}
    assert box.stats.calls == 1 and dict(box.stats.failures) == {kind: 1}
    assert time.time() - t0 < 2  # a hang costs the timeout, not the tool's own time


def test_malformed_calls_from_the_parser_are_tool_messages_and_counted(box):
    replies = box.run([{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 1}}},
                       {"type": "function", "function": {"arguments": {}}}], errors=["malformed tool call '{'"])
    assert [r["content"] for r in replies] == [
        "2", "{'error': \"Tool call without a function name: {'type': 'function', 'function': {'arguments': {}}}\"}",
        "{'error': \"malformed tool call '{'\"}"]
    assert box.stats.calls == 3 and dict(box.stats.failures) == {"malformed": 2}


def test_a_tool_without_hints_or_docstring_and_duplicate_names_are_refused_naming_them():
    def untyped(x):
        """Untyped.

        Args:
            x: A thing.
        """

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match=r"TOOLS entry '.*untyped' has no JSON schema \(TypeHintParsingException"):
        Toolbox([untyped])
    with pytest.raises(ConfigError, match=r"'.*undocumented' has no JSON schema \(DocstringParsingException"):
        tool_schema(undocumented)
    with pytest.raises(ConfigError, match=r"TOOLS has two tools named 'add'"):
        Toolbox([add, add])
    with pytest.raises(ConfigError, match=r"tool 3 is a int, not a callable"):
        tool_schema(3)
    with pytest.raises(ConfigError, match=r"the tool timeout is 0"):
        Toolbox([add], timeout_s=0)


def spin(n: int) -> int:
    """Loop in Python until stopped.

    Args:
        n: Where to start counting.
    """
    while True:
        n += 1


def blocks(text: str) -> list:
    """Answer in TRL's content blocks.

    Args:
        text: The text to answer with.
    """
    return [{"type": "text", "text": text}, {"type": "text", "text": "!"}]


def picture(text: str) -> list:
    """Answer with an image block.

    Args:
        text: Ignored.
    """
    return [{"type": "image", "image": object()}]


def test_a_tool_looping_past_its_timeout_leaves_no_thread_running():
    # Before, its daemon thread spun for the rest of the process: 16 such threads after one short run.
    box = Toolbox([spin], timeout_s=0.2)
    assert box.call("spin", {"n": 0}) == "{'error': 'Tool spin timed out after 0.2 s'}"
    deadline = time.time() + 2
    while any(t.name == "tool-spin" for t in threading.enumerate()) and time.time() < deadline:
        time.sleep(0.02)
    assert not any(t.name == "tool-spin" for t in threading.enumerate())


def test_a_tool_returning_content_blocks_gives_their_text_and_an_image_is_a_clear_error():
    box = Toolbox([blocks, picture])
    assert box.call("blocks", {"text": "hi"}) == "hi!"
    text = box.call("picture", {"text": "x"})
    assert "content block of type 'image'" in text and "text-only" in text and box.stats.failures["raised"] == 1
