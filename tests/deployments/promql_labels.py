"""A reader of the PromQL the dashboard and the alert rules use (tests/deployments/test_dashboard.py): it works out
the labels of an expression's result from the labels each series carries, and refuses a query that names a metric or
a label that is not there, a `by` / `on` / `group_left` label the series lack, a match that can never match a series,
or syntax it does not know (so nothing passes unread: extend it when the dashboard needs more).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class QueryError(ValueError):
    """A query that names what does not exist, matches nothing by construction, or that the reader cannot read."""


AGGREGATIONS = {"sum", "min", "max", "avg", "count", "group", "stddev", "stdvar"}
KEEP_LABELS = {"rate", "irate", "increase", "deriv", "delta", "idelta", "abs", "ceil", "floor", "round", "clamp_min",
               "clamp_max", "avg_over_time", "max_over_time", "min_over_time", "sum_over_time"}
BINARY = [("or",), ("and", "unless"), ("==", "!=", "<=", ">=", "<", ">"), ("+", "-"), ("*", "/", "%"), ("^",)]
TOKEN = re.compile(r"""\s*(?:
    (?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<selector>\{[^}]*\})
  | (?P<range>\[[^\]]*\])
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>==|!=|<=|>=|[-+*/%^<>(),])
)""", re.X)
MATCHER = re.compile(r"""\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*(,|$)""")


@dataclass
class Token:
    """One token of a query: its kind (a TOKEN group) and its text."""

    kind: str
    text: str


def tokenize(expr: str) -> list[Token]:
    tokens, position = [], 0
    while position < len(expr):
        if not expr[position:].strip():
            break
        match = TOKEN.match(expr, position)
        if match is None or match.end() == position:
            raise QueryError(f"cannot read {expr[position:]!r}")
        kind = match.lastgroup
        assert kind is not None
        tokens.append(Token(kind, match.group(kind)))
        position = match.end()
    return tokens


Labels = frozenset[str] | None  # of an expression's result; None: a scalar (a number, scalar())


class Query:
    """Reads one expression and works out the labels of its result, checking on the way that every label it names
    is carried by the series it names it on."""

    def __init__(self, expr: str, labels: dict[str, frozenset[str]]) -> None:
        self.tokens = tokenize(expr)
        self.position = 0
        self.known = labels

    def labels(self) -> Labels:
        result = self.binary(0)
        if self.position != len(self.tokens):
            raise QueryError(f"unexpected {self.tokens[self.position].text!r}")
        return result

    def peek(self) -> Token | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def at(self, *texts: str) -> bool:
        """Whether the next token is one of these."""
        token = self.peek()
        return token is not None and token.text in texts

    def take(self, text: str | None = None) -> Token:
        token = self.peek()
        if token is None or (text is not None and token.text != text):
            raise QueryError(f"expected {text!r}, got {token.text if token else 'the end'!r}")
        self.position += 1
        return token

    def label_list(self) -> frozenset[str]:
        self.take("(")
        names: set[str] = set()
        while not self.at(")"):
            names.add(self.take().text)
            if self.at(","):
                self.take(",")
        self.take(")")
        return frozenset(names)

    def binary(self, level: int) -> Labels:
        if level == len(BINARY):
            return self.unary()
        left = self.binary(level + 1)
        while (token := self.peek()) is not None and token.text in BINARY[level]:
            self.take()
            if self.at("bool"):
                self.take()
            on = ignoring = include = None
            if self.at("on", "ignoring"):
                keyword = self.take().text
                names = self.label_list()
                on, ignoring = (names, None) if keyword == "on" else (None, names)
            if self.at("group_left", "group_right"):
                if self.take().text == "group_right":
                    raise QueryError("group_right: extend the reader")
                include = self.label_list() if self.at("(") else frozenset()
            right = self.binary(level + 1)
            left = self.match(token.text, left, right, on, ignoring, include)
        return left

    @staticmethod
    def match(op: str, left: Labels, right: Labels, on: frozenset[str] | None, ignoring: frozenset[str] | None,
              include: frozenset[str] | None) -> Labels:
        """The labels of `left op right` (Prometheus' vector matching: a one-to-one match keeps the `on` labels, or
        drops the `ignoring` ones; group_left adds the included labels of the right side), refusing a match that
        can never match a series."""
        if left is None or right is None:
            if op in ("and", "or", "unless"):
                raise QueryError(f"{op} needs two vectors")
            return left if right is None else right
        if on is not None:
            missing = on - (left & right)
            if missing:
                raise QueryError(f"on ({', '.join(sorted(on))}): {sorted(missing)} not on both sides")
        elif op not in ("and", "or", "unless") or ignoring is not None:
            kept_left, kept_right = left - (ignoring or frozenset()), right - (ignoring or frozenset())
            if include is None and kept_left != kept_right:
                raise QueryError(f"{op} matches no series: labels {sorted(kept_left)} vs {sorted(kept_right)}")
        if op == "or":
            return left | right
        if op in ("and", "unless"):
            return left
        if include is not None:
            if not include <= right:
                raise QueryError(f"group_left ({', '.join(sorted(include))}): {sorted(include - right)} "
                                 f"not on the right side")
            return left | include
        if on is not None:
            return on
        return left - (ignoring or frozenset())

    def unary(self) -> Labels:
        if self.at("-", "+"):
            self.take()
        return self.primary()

    def primary(self) -> Labels:
        token = self.take()
        if token.kind in ("number", "string"):  # a string only as a function's argument
            return None
        if token.text == "(":
            inner = self.binary(0)
            self.take(")")
            return inner
        if token.kind != "ident":
            raise QueryError(f"unexpected {token.text!r}")
        if token.text in AGGREGATIONS:
            return self.aggregation(token.text)
        if self.at("("):
            return self.function(token.text)
        return self.selector(token.text)

    def grouping(self) -> tuple[str, frozenset[str]] | None:
        token = self.peek()
        if token is not None and token.text in ("by", "without"):
            self.take()
            return token.text, self.label_list()
        return None

    def aggregation(self, name: str) -> frozenset[str]:
        grouping = self.grouping()
        self.take("(")
        inner = self.binary(0)
        self.take(")")
        grouping = grouping or self.grouping()
        if inner is None:
            raise QueryError(f"{name}() of a scalar")
        if grouping is None:
            return frozenset()
        keyword, names = grouping
        if not names <= inner:
            raise QueryError(f"{name} {keyword} ({', '.join(sorted(names))}): {sorted(names - inner)} not on "
                             f"{sorted(inner)}")
        return names if keyword == "by" else inner - names

    def function(self, name: str) -> Labels:
        self.take("(")
        args: list[Labels] = [self.binary(0)]
        while self.at(","):
            self.take(",")
            args.append(self.binary(0))
        self.take(")")
        if name == "scalar":
            return None
        if name == "vector":
            return frozenset()
        if name == "histogram_quantile":
            buckets = args[1]
            if buckets is None or "le" not in buckets:
                raise QueryError("histogram_quantile() of series without `le`: sum them by (le)")
            return buckets - {"le"}
        if name in KEEP_LABELS:
            if args[0] is None:
                raise QueryError(f"{name}() of a scalar")
            return args[0]
        raise QueryError(f"function {name}(): extend the reader")

    def selector(self, name: str) -> frozenset[str]:
        if name not in self.known:
            raise QueryError(f"no metric {name}")
        carried = self.known[name]
        token = self.peek()
        if token is not None and token.kind == "selector":
            self.take()
            body = token.text[1:-1].strip()
            position = 0
            while position < len(body):
                match = MATCHER.match(body, position)
                if match is None:
                    raise QueryError(f"cannot read the matchers {body!r}")
                if match.group(1) not in carried:
                    raise QueryError(f"{name} has no label {match.group(1)!r} (it has {sorted(carried)})")
                position = match.end()
        token = self.peek()
        if token is not None and token.kind == "range":
            self.take()
        return carried


def query_labels(expr: str, labels: dict[str, frozenset[str]]) -> Labels:
    try:
        return Query(expr, labels).labels()
    except QueryError as err:
        raise AssertionError(f"{expr}\n  {err}") from None
