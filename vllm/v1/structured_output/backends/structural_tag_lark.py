"""Structural tags as llguidance Lark grammars, so that the guidance backend takes them too.

The input is a structural tag as the engine accepts it (xgrammar's format,
`{"type": "structural_tag", "format": {...}}`, or the legacy
`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`), as a dict or JSON text.
Format types written here: `const_string`, `json_schema` (JSON style only: xgrammar's
`qwen_xml` style is refused), `regex`, `sequence`, `or`, `tag` and `triggered_tags` (free
text until a trigger, then one of the tags that begin with it, then free text again;
`at_least_one` and `stop_after_first` as in xgrammar). Other types (`grammar`, `any_text`,
`tags_with_separator`, ...) raise UnsupportedConstraintError naming them.

Free text is llguidance's idiom for tool calls: a *lazy* lexeme `TEXT "<trigger"` ends at the
first trigger, so text never holds a trigger that no tag follows. Literal text that is
exactly an added token of the tokenizer (`<tool_call>`, `</tool_call>`: llguidance reads every
added token as special, never as text) is matched either as that token or as its characters,
so a model may write the trigger either way.

Pure Python: the caller supplies the JSON and regex fragments (llguidance's own syntax).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from vllm.exceptions import GrammarCompileError, UnsupportedConstraintError

_FIELD = "structured_outputs.structural_tag"
_TEXT = "TEXT"
_TEXT_RULE = f"{_TEXT}: /(.|\\n)*/"


def parse_structural_tag(value: str | dict[str, Any]) -> dict[str, Any]:
    """The tag's `format` node (legacy tags converted to `triggered_tags`).

    Raises GrammarCompileError when it is not a JSON object or a legacy tag is malformed.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarCompileError(_FIELD, f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise GrammarCompileError(_FIELD, "must be a JSON object")
    if "structures" in value:
        try:
            tags = [
                {"type": "tag", "begin": s["begin"],
                 "content": {"type": "json_schema", "json_schema": s["schema"]},
                 "end": s["end"]}
                for s in value["structures"]
            ]
            return {"type": "triggered_tags", "triggers": list(value["triggers"]), "tags": tags}
        except (KeyError, TypeError) as e:
            raise GrammarCompileError(
                _FIELD,
                f"legacy tags need 'structures' (each with begin, schema, end) and 'triggers': {e}",
            ) from e
    fmt = value.get("format")
    if not isinstance(fmt, dict):
        raise GrammarCompileError(_FIELD, "needs a 'format' object (or legacy 'structures')")
    return fmt


class LarkWriter:
    """Builds one Lark grammar from a structural tag's `format` node.

    `json_fragment(schema)` returns the Lark expression for a JSON schema (`%json {...}`),
    `regex_fragment(pattern)` one for a regex (`/.../`); `added_tokens` maps an added
    token's text to its id.
    """

    def __init__(
        self,
        json_fragment: Callable[[Any], str],
        regex_fragment: Callable[[str], str],
        added_tokens: Mapping[str, int],
    ) -> None:
        self._json = json_fragment
        self._regex = regex_fragment
        # Longest first, so that "</tool_call>" is found before a shorter token inside it.
        self._added = sorted(
            ((text, idx) for text, idx in added_tokens.items() if text), key=lambda t: -len(t[0])
        )
        self._rules: list[str] = []
        self._count = 0
        self._uses_text = False

    def grammar(self, fmt: dict[str, Any]) -> str:
        """The whole grammar: `start` is `fmt`."""
        start = self._node(fmt)
        lines = [f"start: {start}", *self._rules]
        if self._uses_text:
            lines.append(_TEXT_RULE)
        return "\n".join(lines) + "\n"

    def _rule(self, prefix: str, body: str, *, lazy: bool = False) -> str:
        self._count += 1
        name = f"{prefix}_{self._count}"
        self._rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def literal(self, text: str) -> str:
        """`text` as a Lark expression; added tokens inside it match as the token too."""
        if not text:
            return '""'
        parts: list[str] = []
        plain = ""
        i = 0
        while i < len(text):
            hit = next(((t, idx) for t, idx in self._added if text.startswith(t, i)), None)
            if hit is None:
                plain += text[i]
                i += 1
                continue
            if plain:
                parts.append(json.dumps(plain, ensure_ascii=False))
                plain = ""
            token_text, idx = hit
            parts.append(f"(<[{idx}]> | {json.dumps(token_text, ensure_ascii=False)})")
            i += len(token_text)
        if plain:
            parts.append(json.dumps(plain, ensure_ascii=False))
        return " ".join(parts)

    def _node(self, node: Any) -> str:
        if not isinstance(node, dict) or not isinstance(node.get("type"), str):
            raise GrammarCompileError(
                _FIELD, f"each format must be an object with a 'type': {node!r}"[:300]
            )
        kind = node["type"]
        try:
            if kind == "const_string":
                return self.literal(str(node["value"]))
            if kind == "json_schema":
                style = node.get("style", "json")
                if style != "json":  # xgrammar writes e.g. qwen_xml parameters as XML
                    raise UnsupportedConstraintError(
                        _FIELD, f"json_schema style {style!r} (unsupported by llguidance in "
                        "this engine)"
                    )
                return self._json(node["json_schema"])
            if kind == "regex":
                return self._regex(str(node["pattern"]))
            if kind == "sequence":
                elements = [self._node(e) for e in node["elements"]]
                return "(" + " ".join(elements) + ")" if elements else '""'
            if kind == "or":
                elements = [self._node(e) for e in node["elements"]]
                if not elements:
                    raise GrammarCompileError(_FIELD, "'or' needs at least one element")
                return "(" + " | ".join(elements) + ")"
            if kind == "tag":
                return self._tag(node, "")
            if kind == "triggered_tags":
                return self._triggered(node)
        except (KeyError, TypeError) as e:
            raise GrammarCompileError(_FIELD, f"format {kind!r} is missing {e}") from e
        raise UnsupportedConstraintError(
            _FIELD, f"structural tag format {kind!r} (unsupported by llguidance in this engine)"
        )

    def _tag(self, tag: dict[str, Any], skip: str) -> str:
        """`begin content end`, the first len(skip) characters of begin already matched."""
        begin = str(tag["begin"])[len(skip):]
        parts = [self.literal(begin)] if begin else []
        parts += [self._node(tag["content"]), self.literal(str(tag["end"]))]
        return "(" + " ".join(parts) + ")"

    def _triggered(self, node: dict[str, Any]) -> str:
        triggers = [str(t) for t in node["triggers"]]
        tags = list(node["tags"])
        if not triggers or not tags or any(not t for t in triggers):
            raise GrammarCompileError(_FIELD, "triggered_tags needs non-empty triggers and tags")
        self._uses_text = True
        alternatives: list[str] = []
        for trigger in triggers:
            mine = [t for t in tags if str(t.get("begin", "")).startswith(trigger)]
            if not mine:
                continue
            bodies = " | ".join(self._tag(t, trigger) for t in mine)
            # The text before a tag ends at its trigger (lazy), written as characters...
            head = self._rule("trig", f"{_TEXT} {json.dumps(trigger, ensure_ascii=False)}",
                              lazy=True)
            alternatives.append(f"{head} ({bodies})")
            # ... or, when the trigger is an added token, as that token.
            special = dict(self._added).get(trigger)
            if special is not None:
                alternatives.append(f"{_TEXT} <[{special}]> ({bodies})")
        missing = [str(t.get("begin")) for t in tags
                   if not any(str(t.get("begin", "")).startswith(tr) for tr in triggers)]
        if missing:
            raise GrammarCompileError(
                _FIELD, f"tag begin {missing[0]!r} starts with none of the triggers {triggers}"
            )
        one = self._rule("tag", " | ".join(alternatives))
        at_least_one = bool(node.get("at_least_one", False))
        if node.get("stop_after_first", False):
            return one if at_least_one else f"({one} | {_TEXT})"
        return f"{one}+ {_TEXT}" if at_least_one else f"{one}* {_TEXT}"
