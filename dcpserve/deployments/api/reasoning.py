"""A reasoning model's thinking, split out of a chat choice's text: `reasoning_content` beside `content`.

DeepSeek-R1 and Qwen3 write their reasoning first, between `<think>` and `</think>`, then the answer. With the app
arg `reasoning_parser` set (vLLM's --reasoning-parser names: `deepseek_r1`, `qwen3`), the chat shaper
(dcpserve/deployments/api/responses.py) sends the reasoning as message.reasoning_content (streamed:
delta.reasoning_content) and only the answer as content, as vLLM's reasoning parsers do
(vllm/reasoning/basic_parsers.py, deepseek_r1_reasoning_parser.py, vllm/parser/qwen3.py):

- the output starts in the reasoning: R1's template (and Qwen3-2507-Thinking's) opens `<think>` in the prompt, so the
  model may never write it; a `<think>` the model does write is dropped;
- `</think>` ends the reasoning (dropped); the rest is content (None when there is none). An output that never
  ends its reasoning is all reasoning, content None;
- qwen3: a `<tool_call>` also ends the reasoning (it stays in the content, for the tool parser), and a request whose
  chat_template_kwargs turn thinking off ({"enable_thinking": false}) is all content.

Streaming is on the text, not token ids, so a tag split across deltas (`</th` + `ink>`) is held back until it is
known either way; each call returns the reasoning and content text that is now certain.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family of models marks its reasoning in the output text."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    implicit_ends: tuple[str, ...] = ()  # end the reasoning and stay in the content
    honours_enable_thinking: bool = False  # chat_template_kwargs {"enable_thinking": false}: no reasoning at all


FORMATS = {
    "deepseek_r1": ReasoningFormat("deepseek_r1"),
    "qwen3": ReasoningFormat("qwen3", implicit_ends=("<tool_call>",), honours_enable_thinking=True),
}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    """The format of a reasoning_parser name (None: reasoning is not split out)."""
    if name is None:
        return None
    if name not in FORMATS:
        raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSERS)} or unset, got {name!r}")
    return FORMATS[name]


class ReasoningStream:
    """One choice's text split into reasoning and content as it streams; `feed` per delta, `finish` at the end."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool = True) -> None:
        self._fmt = fmt
        self._in_reasoning = thinking or not fmt.honours_enable_thinking
        self.thinks = self._in_reasoning  # whether this choice has a reasoning part at all
        self._start_seen = False
        self._held = ""  # text that may still be the start of a tag

    def _markers(self) -> list[str]:
        found = [self._fmt.end, *self._fmt.implicit_ends]
        return found if self._start_seen else [self._fmt.start, *found]

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) text that this delta's text makes certain."""
        if not self._in_reasoning:
            return "", text
        buffer, reasoning = self._held + text, []
        self._held = ""
        while True:
            hits = [(buffer.find(m), m) for m in self._markers() if m in buffer]
            if not hits:
                break
            at, marker = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
            reasoning.append(buffer[:at])
            if marker == self._fmt.start:
                self._start_seen = True
                buffer = buffer[at + len(marker):]
                continue
            self._in_reasoning = False
            content = buffer[at + len(marker):] if marker == self._fmt.end else buffer[at:]
            return "".join(reasoning), content
        keep = self._partial_marker(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        reasoning.append(buffer[:len(buffer) - keep])
        return "".join(reasoning), ""

    def finish(self) -> tuple[str, str]:
        """What is still held back when the choice ends (a tag that never completed is reasoning text)."""
        held, self._held = self._held, ""
        return (held, "") if self._in_reasoning else ("", held)

    def _partial_marker(self, text: str) -> int:
        """The length of the longest end of `text` that starts a marker (and could complete with the next delta)."""
        longest = 0
        for marker in self._markers():
            for size in range(min(len(marker) - 1, len(text)), longest, -1):
                if marker.startswith(text[-size:]):
                    longest = size
                    break
        return longest


def split_reasoning(fmt: ReasoningFormat, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
    """A finished choice's (reasoning_content, content): reasoning None when the choice has no reasoning part
    (thinking turned off), content None when nothing follows the reasoning."""
    stream = ReasoningStream(fmt, thinking)
    reasoning, content = stream.feed(text)
    rest_reasoning, rest_content = stream.finish()
    reasoning, content = reasoning + rest_reasoning, content + rest_content
    if not stream.thinks:
        return None, content
    return reasoning, content or None
