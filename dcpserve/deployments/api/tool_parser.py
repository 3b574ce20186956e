"""Tool calls read back from a chat choice's generated text (dcpserve/deployments/api/tool_calls.py plans them): whole,
for a JSON answer (`parse_output`), or as OpenAI's streaming tool_calls deltas (`ToolStream`). The constrained modes
(a named function, "required") parse what their constraint made; "auto" parses the built-in `<tool_call>` format as
vLLM's Hermes parser does. Only dcpserve/deployments/api/responses.py uses it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from dcpserve.deployments.api.tool_calls import CALL_CLOSE, CALL_OPEN, ToolPlan


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


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
