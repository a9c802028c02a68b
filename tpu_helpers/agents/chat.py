"""Tool calls in each model's own format: render a conversation to token ids with the model's tokens marked, and parse
what the model wrote back into an assistant message.

    fmt = ChatFormat(tokenizer)                       # native tools, or the one Hermes fallback (see below)
    r = fmt.render(messages, tools=schemas)            # r.ids, r.mask (1: the assistant's own tokens), r.pieces
    ids = fmt.prompt_ids(prompt, tools=schemas)        # up to the generation prompt
    parsed = fmt.parse(generated_ids, prefix=ids, tools=schemas)   # parsed.message, parsed.errors

Native: a chat template that renders a whole tool exchange (the tool schemas, an assistant's `tool_calls`, a `tool`
message: Qwen2.5, Qwen3, Llama 3.1+, Mistral) is used as it is, `apply_chat_template(messages, tools=...)`; the
answer is parsed by transformers' `parse_response` when the tokenizer has a `response_template`, else by the Hermes
parser when the template writes `<tool_call>` blocks (Qwen's), else it is a ConfigError saying what to set.
Fallback, for templates without tools (SmolLM2's ChatML, the package's tiny Qwen2): Qwen2.5's own format through the
model's template: the schemas in the system message (one is added when there is none), each call a
`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` block after the content, and a turn's tool results one
user message of `<tool_response>` blocks. SFT and RL render the same way: `render` tokenizes the conversation piece
by piece, the model's piece of each assistant turn (its text up to the template's end-of-turn token) apart from the
template's text around it, which is exactly the ids an episode gathers turn by turn (prompt, generated, tool text).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tpu_helpers.core.choices import ConfigError

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_SENTINELS = ("tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2", "tool_arg_val_d6e7a9f3", "tool_content_c4f9a8e2")
_SAY = "assistant_text_e5b7c1d3"


@dataclass
class Rendered:
    """A conversation's token ids, `mask` 1 on the assistant's own tokens, and the text pieces (text, is_model)."""

    ids: list[int]
    mask: list[int]
    pieces: list[tuple[str, bool]] = field(default_factory=list)


@dataclass
class Parsed:
    """An assistant message parsed from the model's text, and the malformed calls found in it (each one becomes a
    counted tool message, `Toolbox.run(..., errors=...)`)."""

    message: dict
    errors: list[str] = field(default_factory=list)


def _call_json(call: dict) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):  # some data sets hold the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)


def hermes_messages(messages: Sequence[dict], tools: Sequence[dict] | None) -> list[dict]:
    """The fallback: a tool conversation as plain role/content messages in Qwen2.5's format (module docstring)."""
    out: list[dict] = []
    if tools:
        block = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + block})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in messages:
        if m["role"] == "tool":
            reply = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tools"):
                out[-1]["content"] += "\n" + reply
            else:
                out.append({"role": "user", "content": reply, "_tools": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{_call_json(c)}\n</tool_call>" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m.get("content") or "") + ("\n" if m.get("content") else "")
                        + calls})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    return [{k: v for k, v in m.items() if k != "_tools"} for m in out]


def parse_hermes(text: str) -> Parsed:
    """`<tool_call>{json}</tool_call>` blocks (any number) out of an answer's text: the calls in order, the text
    outside the valid blocks as content; a block that is not JSON of {"name": str, "arguments": object}, and an
    unclosed one (a cut answer), is an error and stays in the content as written."""
    calls, errors, kept = [], [], []
    last = 0
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ValueError('not an object with a "name" string')
            arguments = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                raise ValueError('"arguments" is not an object')
        except ValueError as err:  # json.JSONDecodeError is a ValueError
            errors.append(f"malformed tool call {m.group(1)[:200]!r}: {err}")
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append({"type": "function", "function": {"name": obj["name"], "arguments": arguments}})
    kept.append(text[last:])
    content = "".join(kept).strip()
    tail = text[text.rfind("<tool_call>"):] if "<tool_call>" in text else ""
    if tail and "</tool_call>" not in tail:
        errors.append(f"unclosed tool call {tail[:200]!r} (the answer was cut, or the block never closed)")
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return Parsed(message, errors)


class ChatFormat:
    """How one tokenizer renders and parses tool conversations (see the module docstring). `chat_template`
    replaces the tokenizer's own, e.g. a prefix-preserving training template (TRL ships some)."""

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        if (chat_template or getattr(tokenizer, "chat_template", None)) is None:
            raise ConfigError(f"the tokenizer {type(tokenizer).__name__} has no chat template; a tool conversation "
                              "is rendered through one (give chat_template=...)")
        self.native, sample = self._probe_tools()
        self.end = self._end_of_turn()
        self.response_template = getattr(tokenizer, "response_template", None)
        if self.native and self.response_template is None and "<tool_call>" not in sample:
            raise ConfigError("the chat template renders tool calls in its own format and the tokenizer has no "
                              "response_template to parse them: set tokenizer.response_template (TRL's "
                              "add_response_schema sets one for Llama 3.1/3.2, Qwen, GLM, ...), or render without "
                              "tools support through the Hermes fallback (a template without tools)")
        self.parser = "response_template" if self.native and self.response_template is not None else "hermes"

    # ---- rendering ---------------------------------------------------------------------------------------------
    def _apply(self, messages: Sequence[dict], tools: Sequence[dict] | None, generation: bool,
               native: bool | None = None) -> str:
        native = self.native if native is None else native
        if not native:
            messages, tools = hermes_messages(messages, tools), None
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                  chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=generation)

    def _probe_tools(self) -> tuple[bool, str]:
        """Whether the template renders every part of a tool exchange (TRL's check, plus the schemas), and the text."""
        name, key, value, content = _SENTINELS
        schema = {"type": "function", "function": {"name": name, "description": "d", "parameters": {
            "type": "object", "properties": {key: {"type": "string", "description": "k"}}, "required": [key]}}}
        messages = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": name, "arguments": {key: value}}}]},
                    {"role": "tool", "name": name, "content": content}]
        try:
            text = self._apply(messages, [schema], False, native=True)
            with_tools = self._apply(messages[:1], [schema], True, native=True)
        except Exception:  # noqa: BLE001 (a template that rejects the roles or the tools has no tool support)
            return False, ""
        return all(s in text for s in _SENTINELS) and name in with_tools, text

    def _specials(self) -> list[str]:
        tok = self.tokenizer
        found = set(getattr(tok, "all_special_tokens", []))
        found |= {t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if getattr(t, "special", False)}
        return sorted(found, key=len, reverse=True)

    def _end_of_turn(self) -> str:
        """The special token the template closes an assistant turn with: the model's last token of a turn."""
        user = [{"role": "user", "content": "hi"}]
        before = self._apply(user, None, True)
        text = self._apply([*user, {"role": "assistant", "content": _SAY}], None, False)
        after = text[text.find(_SAY) + len(_SAY):] if _SAY in text and text.startswith(before) else ""
        hits = [(after.find(s), s) for s in self._specials() if s and s in after]
        if not hits:
            raise ConfigError(f"the chat template writes no special token after an assistant's text ({after!r}); "
                              "an answer must end with one (the end of turn the generation stops at)")
        return min(hits)[1]

    def pieces(self, messages: Sequence[dict], tools: Sequence[dict] | None = None, *,
               generation_prompt: bool = False) -> list[tuple[str, bool]]:
        """The conversation's text as pieces (text, is the model's): each assistant turn's text up to and with the
        end-of-turn token is the model's; the rest (system, user, tool text, headers) is the template's."""
        out: list[tuple[str, bool]] = []
        done = ""
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._apply(messages[:i], tools, True)
            self._require_prefix(done, before, i)
            if before[len(done):]:
                out.append((before[len(done):], False))
            turn = self._apply(messages[:i + 1], tools, False)
            self._require_prefix(before, turn, i)
            own = turn[len(before):]
            end = own.find(self.end)
            if end < 0:
                raise ConfigError(f"message {i} (assistant) renders without the end-of-turn token {self.end!r}: "
                                  f"{own[:200]!r}")
            own = own[:end + len(self.end)]
            out.append((own, True))
            done = before + own
        final = self._apply(messages, tools, generation_prompt)
        self._require_prefix(done, final, len(messages))
        if final[len(done):]:
            out.append((final[len(done):], False))
        return out

    def _require_prefix(self, prefix: str, text: str, i: int) -> None:
        if not text.startswith(prefix):
            at = next((j for j, (a, b) in enumerate(zip(prefix, text, strict=False)) if a != b), min(len(prefix), len(text)))
            raise ConfigError(
                f"the chat template is not prefix-preserving: rendering up to message {i} rewrites earlier text "
                f"(at character {at}: {prefix[at:at + 60]!r} became {text[at:at + 60]!r}); an episode grows turn by "
                "turn, so give a template that renders earlier messages the same whatever follows (e.g. TRL's "
                "trl/chat_templates/*_training.jinja) as chat_template=")

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None, *,
               generation_prompt: bool = False) -> Rendered:
        """Token ids of the conversation, piece by piece, and the loss mask: 1 on the assistant's own tokens."""
        pieces = self.pieces(messages, tools, generation_prompt=generation_prompt)
        ids: list[int] = []
        mask: list[int] = []
        for text, own in pieces:
            piece = self._ids(text)
            ids += piece
            mask += [int(own)] * len(piece)
        return Rendered(ids, mask, pieces)

    def prompt_ids(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """The ids a turn's generation starts from: the conversation so far and the generation prompt."""
        return self.render(messages, tools, generation_prompt=True).ids

    def continuation_ids(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """The template's ids after the last assistant turn's end-of-turn token (its tool messages and the next
        generation prompt): what an episode appends to its buffer between turns."""
        pieces = self.pieces(messages, tools, generation_prompt=True)
        return self._ids(pieces[-1][0]) if pieces and not pieces[-1][1] else []

    # ---- parsing -----------------------------------------------------------------------------------------------
    def parse(self, ids: Sequence[int], *, prefix: Sequence[int] | None = None,
              tools: Sequence[dict] | None = None) -> Parsed:
        """The assistant message in the generated ids (up to the end-of-turn token; what follows it is dropped)."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        cut = text.find(self.end)
        body = text[:cut] if cut >= 0 else text
        eos = getattr(self.tokenizer, "eos_token", None)
        if eos:
            body = body.removesuffix(eos)
        if self.parser == "hermes":
            return parse_hermes(body)
        try:
            message = self.tokenizer.parse_response(text, prefix=self.tokenizer.decode(list(prefix or [])),
                                                    tools=list(tools) if tools else None)
            if not isinstance(message, dict):
                raise ValueError(f"parse_response returned {message!r}")
        except Exception as err:  # noqa: BLE001 (a malformed answer is the model's, never a crashed run)
            return Parsed({"role": "assistant", "content": body.strip()},
                          [f"malformed tool call ({type(err).__name__}: {str(err)[:200]})"])
        message = {"role": "assistant", **message}
        message["content"] = message.get("content") or ""
        calls, errors = [], []
        for call in message.pop("tool_calls", None) or []:
            function = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                    or not isinstance(function.get("arguments", {}), dict):
                errors.append(f"malformed tool call {call!r}")
                continue
            calls.append({"type": "function", "function": {"name": function["name"],
                                                           "arguments": function.get("arguments", {})}})
        if calls:
            message["tool_calls"] = calls
        return Parsed(message, errors)
