"""Tools in TRL's form: typed Python functions with Google-style docstrings, their JSON schemas, and running a call.

    box = Toolbox([multiply, lookup], timeout_s=10)      # schemas through transformers' get_json_schema
    box.schemas                                           # [{"type": "function", "function": {...}}, ...]
    messages = box.run(parsed.tool_calls, errors=parsed.errors)   # tool messages, one per call or error
    box.stats                                             # ToolStats: calls, failures, and each failure's kind

A tool is what `GRPOTrainer(tools=[...])` takes: sync or async, any return value (a list of TRL's content blocks
gives its text blocks' text; another non-string value becomes its `str()`, as TRL does). A call never raises here:
an exception, a call past `timeout_s`, wrong arguments, an unknown tool name, or a malformed call the parser found
becomes the tool message's text, `str({"error": message})` as TRL writes it, and is counted in `ToolStats` by kind.
TRL has no timeout (it waits); here a hung call is stopped: a sync tool runs in a daemon thread joined with the
timeout, past which the thread is ended (`_stop`: at once in Python, when its C call returns otherwise; its result
is dropped); an async tool is awaited on one event loop in a daemon thread, so this works inside a notebook's
running loop too.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tpu_helpers.core.choices import ConfigError

FAILURE_KINDS = ("raised", "timeout", "wrong_args", "unknown_tool", "malformed")


def tool_schema(fn: Callable, *, where: str = "tool") -> dict:
    """transformers' get_json_schema(fn), `{"type": "function", "function": {...}}`: what apply_chat_template builds
    from a callable in `tools=` (TRL passes the callables there); a tool without type hints or a docstring is a ConfigError
    naming it and what get_json_schema asks for."""
    from transformers.utils import get_json_schema

    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    if not callable(fn):
        raise ConfigError(f"{where} {fn!r} is a {type(fn).__name__}, not a callable; a tool is a typed function with "
                          "a Google-style docstring")
    try:
        return get_json_schema(fn)
    except Exception as err:  # TypeHintParsingException, DocstringParsingException, and what they do not catch
        raise ConfigError(f"{where} {name!r} has no JSON schema ({type(err).__name__}: {err}); a tool needs a type "
                          "hint on every argument and a Google-style docstring with a description and an 'Args:' "
                          "line per argument (transformers' get_json_schema)") from None


def block_text(content: Any, *, where: str) -> str:
    """A message's content as text: a string as it is, or TRL's list of content blocks (`[{"type": "text", "text":
    ...}]`, what `reset` and tools may return) with its text blocks joined. An image block is a ConfigError until the
    package trains vision models; anything else is a ConfigError naming `where`."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for block in content:
            kind = block.get("type") if isinstance(block, Mapping) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind in ("image", "image_url", "video", "audio"):
                raise ConfigError(f"{where} returned a content block of type {kind!r}; the package trains text-only models "
                                  "for now, so only text blocks ({'type': 'text', 'text': ...}) are taken")
            else:
                raise ConfigError(f"{where} returned the content block {block!r:.120}; a content block is TRL's "
                                  "{'type': 'text', 'text': ...}")
        return "".join(texts)
    raise ConfigError(f"{where} returned a {type(content).__name__}; it must return a string, a list of TRL's "
                      "content blocks ([{'type': 'text', 'text': ...}]) or None")


def error_text(message: str) -> str:
    """A failed call's tool message text, as TRL writes it: the str() of {"error": message}."""
    return str({"error": message})


@dataclass
class ToolStats:
    """Counts over the calls run: `calls` (each call attempted, malformed ones included), `failures` by kind
    (FAILURE_KINDS), and `converted` (calls whose non-string return became its str(), as TRL does; not a failure)."""

    calls: int = 0
    failures: Counter = field(default_factory=Counter)
    converted: int = 0

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def add(self, other: ToolStats) -> None:
        self.calls += other.calls
        self.failures.update(other.failures)
        self.converted += other.converted


class _Loop:
    """One event loop in a daemon thread, started on first use, for every async tool and reward of the process
    (a notebook's own loop already runs in the main thread, so asyncio.run cannot be used there)."""

    lock = threading.Lock()
    loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls.lock:
            if cls.loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="tpu_helpers-agents-loop", daemon=True).start()
                cls.loop = loop
            return cls.loop


def run_async(coro: Any, timeout_s: float | None = None) -> Any:
    """The result of a coroutine awaited on the daemon loop; asyncio.TimeoutError past timeout_s (it is cancelled)."""
    return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout_s), _Loop.get()).result()


class ToolTimeout(BaseException):
    """Raised inside a tool's thread that ran past its timeout, to end it (a BaseException: the tool's own
    `except Exception` does not swallow it)."""


def _stop(thread: threading.Thread) -> None:
    """End a timed-out tool's thread: ToolTimeout is raised in it at its next Python instruction, so a tool looping
    in Python ends at once, one sleeping or blocked in C when that call returns. One still running a moment later
    (in C) is said once, with how many are left: only a process can be killed (agents.sandbox runs code so)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(ToolTimeout))
    thread.join(0.05)
    if thread.is_alive():
        first = not _STUCK
        _STUCK.add(thread)
        alive = sum(t.is_alive() for t in _STUCK)
        if first:
            warnings.warn(f"tool thread {thread.name!r} is still running past its timeout, in C code (a sleep, a "
                          "blocking call), and ends only when that call returns; its result is dropped "
                          f"({alive} such threads now). Give such a tool a timeout of its own", stacklevel=4)


_STUCK: set = set()  # tool threads that outlived their timeout, in C: said once, when the first is added


def _run_sync(fn: Callable, arguments: dict, timeout_s: float | None) -> Any:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(**arguments)
        except BaseException as err:  # noqa: BLE001 (handed to the caller's thread)
            box["error"] = err

    thread = threading.Thread(target=target, name=f"tool-{getattr(fn, '__name__', 'tool')}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        _stop(thread)
        raise TimeoutError
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Toolbox:
    """Tools by name, their schemas, and the runner of calls (see the module docstring). Names must be unique:
    TRL keeps the last of two tools of one name silently; here it is an error naming both."""

    def __init__(self, tools: Sequence[Callable] = (), *, timeout_s: float | None = 30.0, where: str = "TOOLS"):
        if timeout_s is not None and not timeout_s > 0:
            raise ConfigError(f"the tool timeout is {timeout_s!r}; give a number of seconds above 0, or None for none")
        self.timeout_s = timeout_s
        self.tools: dict[str, Callable] = {}
        self.schemas: list[dict] = []
        for fn in tools:
            schema = tool_schema(fn, where=f"{where} entry")
            name = schema["function"]["name"]
            if name in self.tools:
                raise ConfigError(f"{where} has two tools named {name!r} ({self.tools[name]!r} and {fn!r}); a model "
                                  "calls a tool by its name, so names must be unique")
            self.tools[name] = fn
            self.schemas.append(schema)
        self.stats = ToolStats()

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def call(self, name: str, arguments: Any) -> str:
        """One call's tool message text: the tool's result as a string, or the error text of a failure (counted)."""
        self.stats.calls += 1
        fn = self.tools.get(name)
        if fn is None:
            # TRL's own text for it: ValueError(f"Tool {name} not found.")
            return self._fail("unknown_tool", f"Tool {name} not found.")
        try:
            if not isinstance(arguments, dict):
                raise TypeError(f"{name}() argument after ** must be a mapping, not {type(arguments).__name__}")
            if inspect.iscoroutinefunction(fn):
                result = run_async(fn(**arguments), self.timeout_s)
            else:
                result = _run_sync(fn, arguments, self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            return self._fail("timeout", f"Tool {name} timed out after {self.timeout_s:g} s")
        except TypeError as err:  # Python's own message for wrong arguments is TRL's text for them
            wrong = binds(fn, arguments) is False
            return self._fail("wrong_args" if wrong else "raised", str(err))
        except Exception as err:  # noqa: BLE001 (a tool's failure is the model's feedback, never a crashed run)
            return self._fail("raised", str(err))
        if isinstance(result, str):
            return result
        if isinstance(result, list) and result and all(isinstance(b, dict) and "type" in b for b in result):
            try:  # TRL's content blocks: their text
                return block_text(result, where=f"tool {name!r}")
            except ConfigError as err:
                return self._fail("raised", str(err))
        self.stats.converted += 1
        return str(result)

    def _fail(self, kind: str, message: str) -> str:
        self.stats.failures[kind] += 1
        return error_text(message)

    def run(self, tool_calls: Sequence[dict] | None, errors: Sequence[str] = ()) -> list[dict]:
        """The tool messages answering one assistant message: one per call (in order; `{"role": "tool", "name",
        "content"}` as TRL appends them), then one per malformed call the parser reported (`errors`, counted)."""
        out = []
        for call in tool_calls or ():
            function = call.get("function", call) if isinstance(call, dict) else {}
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str):
                self.stats.calls += 1
                out.append({"role": "tool", "name": "unknown", "content": self._fail(
                    "malformed", f"Tool call without a function name: {call!r}")})
                continue
            out.append({"role": "tool", "name": name, "content": self.call(name, function.get("arguments", {}))})
        for message in errors:
            self.stats.calls += 1
            out.append({"role": "tool", "name": "unknown", "content": self._fail("malformed", message)})
        return out


def binds(fn: Callable, arguments: Any) -> bool | None:
    """Whether the arguments fit fn's signature (None: no signature to check)."""
    if not isinstance(arguments, dict):
        return False
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError:
        return False
    except ValueError:
        return None
    return True
