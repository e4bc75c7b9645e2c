"""Checks on regex and grammar constraints that xgrammar would compile but not honour.

- `find_lookaround`: xgrammar's regex dialect has no lookarounds; a regex (or JSON-schema
  pattern) that uses one is rejected instead of being compiled into something else.
- `find_stuck_rule` / `check_grammar_text`: a grammar rule reachable from the root that can
  never finish would leave generation with no allowed token.

Separate from the backend because `find_stuck_rule` reads xgrammar's serialized grammar
format (`Grammar.serialize_json`), which is version-pinned (`_KNOWN_GRAMMAR_FORMAT`) and
changes with xgrammar releases; on an unknown format it checks nothing. xgrammar itself is
imported only when a grammar's text is checked, so the JSON-schema checks can use
`find_lookaround` without it.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

from vllm.exceptions import GrammarCompileError

if TYPE_CHECKING:
    import xgrammar as xgr


def find_lookaround(regex: str) -> str | None:
    """Returns the first lookaround group opener (`(?=`, `(?!`, `(?<=`, `(?<!`) in `regex`."""
    i, in_class = 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            # A "]" right after "[" or "[^" is a literal member of the class.
            if regex[i + 1 : i + 2] == "^":
                i += 1
            if regex[i + 1 : i + 2] == "]":
                i += 1
        elif c == "(":
            for opener in ("(?=", "(?!", "(?<=", "(?<!"):
                if regex.startswith(opener, i):
                    return opener
        i += 1
    return None


# xgrammar's serialized grammar format this module can read (Grammar.serialize_json); its
# expression types, in xgrammar's order.
_KNOWN_GRAMMAR_FORMAT = "v18"
(
    _BYTE_STRING,
    _CHAR_CLASS,
    _CHAR_CLASS_STAR,
    _EMPTY_STR,
    _RULE_REF,
    _SEQUENCE,
    _CHOICES,
    _TAG_DISPATCH,
    _REPEAT,
) = range(9)


def find_stuck_rule(grammar: xgr.Grammar) -> str | None:
    """Returns the name of a rule reachable from the root that can never finish, else None.

    Such a rule derives no finite string (`root ::= root "a"`, or `a ::= b` and `b ::= a`):
    once generation enters it, no token is ever allowed again. Left recursion with a way out
    (`root ::= "b" | root "a"`) is fine. Returns None, checking nothing, when the grammar's
    serialized form is not the one this function knows.
    """
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") != _KNOWN_GRAMMAR_FORMAT:
        return None
    rules = data["rules"]
    flat, starts = data["grammar_expr_data"], data["grammar_expr_indptr"]

    def expr(i: int) -> tuple[int, list[int]]:
        start = starts[i]
        return flat[start], flat[start + 2 : start + 2 + flat[start + 1]]

    # Rules each rule refers to (through its body and its lookahead), for reachability and to
    # revisit a rule when one it uses becomes finishable.
    uses: list[set[int]] = []
    for rule in rules:
        refs: set[int] = set()
        todo = [e for e in (rule[1], rule[2]) if e >= 0]
        while todo:
            kind, args = expr(todo.pop())
            if kind in (_RULE_REF, _REPEAT):
                refs.add(args[0])
            elif kind in (_SEQUENCE, _CHOICES):
                todo.extend(args)
            elif kind == _TAG_DISPATCH:
                refs.update(args[1:-2:2])
            elif kind not in (_BYTE_STRING, _CHAR_CLASS, _CHAR_CLASS_STAR, _EMPTY_STR):
                return None  # an expression type this function does not know
        uses.append(refs)

    finishable: set[int] = set()

    def can_finish(i: int) -> bool:
        kind, args = expr(i)
        if kind == _RULE_REF:
            return args[0] in finishable
        if kind == _REPEAT:
            return args[1] == 0 or args[0] in finishable
        if kind == _SEQUENCE:
            return all(can_finish(a) for a in args)
        if kind == _CHOICES:
            return any(can_finish(a) for a in args)
        return True  # literals, character classes, empty strings, tag dispatch

    # Least fixpoint: a rule can finish once its body can, given the rules known to finish.
    used_by: list[list[int]] = [[] for _ in rules]
    for user, refs in enumerate(uses):
        for ref in refs:
            used_by[ref].append(user)
    todo = list(range(len(rules)))
    while todo:
        r = todo.pop()
        if r not in finishable and can_finish(rules[r][1]):
            finishable.add(r)
            todo.extend(used_by[r])

    root = data["root_rule_id"]
    reachable, todo = {root}, [root]
    while todo:
        for ref in uses[todo.pop()]:
            if ref not in reachable:
                reachable.add(ref)
                todo.append(ref)
    stuck = sorted(r for r in reachable if r not in finishable)
    if not stuck:
        return None
    return rules[root if root in stuck else stuck[0]][0]


@functools.lru_cache(maxsize=256)
def check_grammar_text(text: str) -> None:
    """Raises ValueError when the EBNF or Lark grammar `text` has a rule that cannot finish.

    Cached: the engine compiles each request's grammar again after the API server did.
    Parse errors are left to the compiler, which reports them.
    """
    import xgrammar as xgr  # deferred: see the module docstring

    lark = "::=" not in text
    try:
        grammar = xgr.Grammar.from_lark(text) if lark else xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError):
        return
    rule = find_stuck_rule(grammar)
    if rule is not None:
        if lark and rule == "root":
            rule = "start"  # xgrammar renames Lark's start rule
        raise GrammarCompileError(
            "structured_outputs.grammar",
            f"rule {rule!r} can never finish (it is left-recursive "
            "or cyclic with no alternative that ends), so generation would get stuck"
        )
