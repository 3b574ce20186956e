"""OpenAI tools on the chat API: the tool definitions, what tool_choice makes of the output, the prompt, and the tool
calls read back from the generated text, whole or as stream deltas in OpenAI's shape.

tool_choice (OpenAI's meanings):
- "none": the output is text; the tools are still shown to the model.
- "auto" (the default with tools): unconstrained; tool calls the model writes in the built-in format are returned as
  tool_calls, the text around them as content.
- "required": the output is constrained to a JSON array of {"name": <a tool>, "arguments": <its parameters>} calls,
  at least one (exactly one with parallel_tool_calls=false).
- {"type": "function", "function": {"name": N}}: the output is constrained to N's parameters schema; it is the call's
  arguments, streamed as they are generated.
A response with tool calls has finish_reason "tool_calls" (unless it hit max_tokens: "length", its text as content).

The prompt: a model whose chat template renders tools (it mentions `tools`) gets them through the template, with
assistant tool_calls and tool results as messages. Other templates (the tiny model's) get the built-in format: a
system message lists the tools as JSON and asks for calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes' and Qwen's format), and past calls are written
back into the assistant's turn the same way.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcpserve.deployments.api.structured import FieldError
from dcpserve.engine.structured_output import StructuredOutput

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
# The function-name rule OpenAI applies.
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """A chat request's tools and what its tool_choice makes of the output."""

    tools: list[ToolDef]
    mode: Literal["none", "auto", "required", "named"]
    named: str | None = None
    parallel: bool = True

    def parameters(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools if t.function.name == name)
        return tool.function.parameters or {"type": "object", "properties": {}}

    def constraint(self) -> StructuredOutput | None:
        """The output constraint tool_choice implies: the named tool's parameters, or for "required" an array of
        calls to any of the tools; none for "none" and "auto"."""
        if self.named is not None:  # set exactly when tool_choice names a function
            return StructuredOutput.json(self.parameters(self.named))
        if self.mode != "required":
            return None
        call = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                  "arguments": self.parameters(t.function.name)},
                 "required": ["name", "arguments"]} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "items": call[0] if len(call) == 1 else {"anyOf": call},
                                  "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput.json(schema)

    def openai_tools(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools]


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); FieldError naming tools or tool_choice when they are malformed
    or tool_choice names no given tool."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise FieldError("tool_choice", f"tool_choice {tool_choice!r} needs tools: send tools, or omit "
                             f"tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"{len(tools)} tools given; at most {MAX_TOOLS}")
    try:
        parsed = [ToolDef.model_validate(t) for t in tools]
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise FieldError("tools", f"tools: {where}: {first['msg']}") from None
    names = [t.function.name for t in parsed]
    if len(set(names)) != len(names):
        raise FieldError("tools", f"tools name a function twice: {sorted({n for n in names if names.count(n) > 1})}")
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolPlan(parsed, tool_choice or "auto", None, parallel)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(function, dict):
        name = function.get("name")
        if name not in names:
            raise FieldError("tool_choice", f"tool_choice names function {name!r}, which is not among the tools "
                             f"{names}")
        return ToolPlan(parsed, "named", name, parallel)
    raise FieldError("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', "
                     f"'function': {{'name': ...}}}}, got {tool_choice!r}")


# ---- the prompt ------------------------------------------------------------------------------------------------


def builtin_tools_prompt(plan: ToolPlan) -> str:
    """The system text that shows the tools to a model whose template cannot (the built-in format)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.openai_tools())
    return ("You may call these tools (JSON definitions, one per line):\n" + listing + "\nTo call one, write "
            + CALL_OPEN + '{"name": <tool name>, "arguments": <arguments object>}' + CALL_CLOSE
            + "; one such block per call.")


def builtin_call_text(calls: list[dict[str, Any]]) -> str:
    """An assistant's past tool calls as built-in-format text."""
    parts = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ValueError(f"an assistant's tool_calls entries must be {{'id', 'type': 'function', 'function': "
                             f"{{'name', 'arguments'}}}}, got {call!r}")
        arguments = function.get("arguments") or "{}"
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        parts.append(CALL_OPEN + json.dumps({"name": function.get("name"), "arguments": arguments},
                                            ensure_ascii=False) + CALL_CLOSE)
    return "".join(parts)


def builtin_messages(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tools in a system message, calls and results as text."""
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content") or ""
        if message.get("tool_calls"):
            content += builtin_call_text(message["tool_calls"])
        out.append({"role": message["role"], "content": content})
    if plan is not None:
        text = builtin_tools_prompt(plan)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


# ---- reading calls back ----------------------------------------------------------------------------------------


def _call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def parse_output(plan: ToolPlan, text: str, finish: str | None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished output. An output cut by max_tokens ("length") has no calls: its text
    is the content, a valid prefix of what the constraint allows."""
    if finish == "length" or plan.mode == "none":
        return text, []
    if plan.named is not None:
        return None, [_call(plan.named, text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, [_call(item["name"], item["arguments"]) for item in items]
    return parse_builtin(text, {t.function.name for t in plan.tools})


def parse_builtin(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """The built-in format's calls in free text (auto): each well-formed block naming a given tool is a call; the
    rest of the text (malformed blocks included, as written) is the content."""
    calls: list[dict[str, Any]] = []
    content: list[str] = []
    rest = text
    while True:
        start = rest.find(CALL_OPEN)
        end = rest.find(CALL_CLOSE, start + len(CALL_OPEN)) if start >= 0 else -1
        if start < 0 or end < 0:
            content.append(rest)
            break
        block = rest[start + len(CALL_OPEN):end]
        try:
            item = json.loads(block)
            ok = isinstance(item, dict) and item.get("name") in names and isinstance(item.get("arguments"), dict)
        except json.JSONDecodeError:
            ok = False
        content.append(rest[:start])
        if ok:
            calls.append(_call(item["name"], item["arguments"]))
        else:
            content.append(rest[start:end + len(CALL_CLOSE)])
        rest = rest[end + len(CALL_CLOSE):]
    joined = "".join(content)
    return (joined if joined.strip() or not calls else None), calls


@dataclass
class ToolStream:
    """One streamed choice's text turned into chat deltas: content, or tool_calls in OpenAI's streaming shape (the
    first delta of call i carries its index, id, type and name; later ones only argument text)."""

    plan: ToolPlan
    _held: str = ""
    _started: bool = False
    _call_id: str = field(default_factory=new_call_id)
    num_calls: int = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas for a piece of generated text (possibly none yet: held until it is known to be content)."""
        if not text:
            return []
        mode = self.plan.mode
        if mode == "none":
            return [{"content": text}]
        if mode == "named":
            if self._started:
                return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
            self._started = True
            self.num_calls = 1
            return [{"tool_calls": [{"index": 0, "id": self._call_id, "type": "function",
                                     "function": {"name": self.plan.named, "arguments": text}}]}]
        self._held += text
        if mode == "required" or CALL_OPEN in self._held:
            return []  # a call array or block in progress: parsed whole at the end
        # auto: hold back only a tail that could still become "<tool_call>".
        keep = next((n for n in range(min(len(CALL_OPEN) - 1, len(self._held)), 0, -1)
                     if CALL_OPEN.startswith(self._held[-n:])), 0)
        out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return [{"content": out}] if out else []

    def finish(self, finish: str | None) -> list[dict[str, Any]]:
        """The deltas left at the end: held content, or the calls parsed from the held text."""
        if self.plan.mode in ("none", "named") or not self._held:
            return []
        held, self._held = self._held, ""
        content, calls = parse_output(self.plan, held, finish)
        deltas: list[dict[str, Any]] = [{"content": content}] if content else []
        for i, call in enumerate(calls):
            deltas.append({"tool_calls": [{"index": i, **call}]})
        self.num_calls = len(calls)
        return deltas


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    """OpenAI's finish_reason for a chat choice that made num_calls tool calls."""
    if reason is None:
        return None
    if reason == "length":
        return "length"
    return "tool_calls" if num_calls else "stop"


def chat_message(plan: ToolPlan | None, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """A finished choice's message and finish_reason."""
    if plan is None:
        return {"role": "assistant", "content": text}, finish_reason(finish, 0)
    content, calls = parse_output(plan, text, finish)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, finish_reason(finish, len(calls))
