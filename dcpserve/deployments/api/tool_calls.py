"""OpenAI tools on the chat API, the request's side: the tool definitions, what tool_choice makes of the output, and
the prompt. The calls read back from the generated text: dcpserve/deployments/api/tool_parser.py.

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
from dataclasses import dataclass
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
            named = next(t for t in self.tools if t.function.name == self.named)
            return StructuredOutput.json(self.parameters(self.named), strict=bool(named.function.strict))
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
