"""The engine's error vocabulary: what kind of failure happened, decided where it happened.

Layers above (the OpenAI server, the offline API) decide what a failure means to the caller
by its type or its `ErrorKind`, never by its wording. A request error raised in the API
server is an exception from this module; one that ends a request inside the engine-core
process travels back as an `ErrorKind` on the request's last output, next to its message.
"""

from __future__ import annotations

import enum
import re


class ErrorKind(str, enum.Enum):
    """Why a request (or the engine) failed, in terms the caller can act on.

    Sent across the engine-core boundary by value (msgspec encodes the string), so adding a
    member is a protocol change for both processes; they always ship together.
    """

    # The request itself is malformed or out of range; the client must change it (400).
    INVALID_REQUEST = "invalid_request"
    # The request's output constraint does not compile, cannot be satisfied, exceeds a
    # limit or took too long to compile; the client must change it (400).
    GRAMMAR = "grammar"
    # The engine's configuration is invalid (a startup failure, never a request's).
    CONFIG = "config"
    # An engine bug: the request was valid but the engine failed it (500).
    INTERNAL = "internal"


class InvalidRequestError(ValueError):
    """A request the engine will not run because of one of its inputs.

    `param` names the offending field the way the client spelled it ("max_tokens",
    "structured_outputs.json", "messages[2]"), or is None when no single field is to blame.
    `str(e)` is "param: message", the text clients have always seen, so the field name is
    visible in logs too; code reads the attributes instead of parsing the text.
    A ValueError so that callers that predate this hierarchy still catch it.
    """

    kind: ErrorKind = ErrorKind.INVALID_REQUEST

    def __init__(self, param: str | None, message: str) -> None:
        self.param = param
        self.message = message
        super().__init__(f"{param}: {message}" if param else message)

    def __reduce__(self) -> tuple[type[InvalidRequestError], tuple[str | None, str]]:
        # Crosses process boundaries (compile workers) by pickle; the default reduce would
        # call the constructor with the formatted text as the only argument.
        return (type(self), (self.param, self.message))

    def copy(self) -> InvalidRequestError:
        """A fresh exception of the same type and fields (no traceback), for re-raising a
        remembered verdict from several threads without sharing one traceback."""
        return type(self)(self.param, self.message)


class GrammarCompileError(InvalidRequestError):
    """The output constraint does not compile, admits no output, exceeds a configured limit,
    or took longer than the compile time limit. The client's fault, like any bad input."""

    kind = ErrorKind.GRAMMAR


class UnsupportedConstraintError(GrammarCompileError):
    """The constraint is well formed but one backend cannot enforce it exactly (it would drop
    a keyword or feature, so an output could violate it). With the `auto` backend the next
    backend is tried; when none can enforce it, the client gets this error (400)."""


class EngineConfigError(ValueError):
    """The engine cannot start with this configuration (reported from the engine-core
    process at startup). A ValueError, as configuration errors raised in-process are."""


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served any more."""


def error_kind_of(e: BaseException) -> ErrorKind:
    """The kind of an exception that ends one request where it was raised.

    Only this module's request errors are the client's fault; any other exception (a plain
    ValueError included) comes from code that should have raised a typed error and is
    treated as an engine bug.
    """
    if isinstance(e, InvalidRequestError):
        return e.kind
    return ErrorKind.INTERNAL


# Terminal escape sequences: CSI (colours, cursor moves), OSC (titles, hyperlinks) ended by BEL
# or ST, and the two-byte escapes; then the 8-bit CSI.
_ANSI = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
    r"|\x1b[@-Z\\-_]?"
    r"|\x9b[0-?]*[ -/]*[@-~]"
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")
_TRACEBACK_HEADER = "Traceback (most recent call last):"
# The lines Python prints between the tracebacks of chained exceptions.
_CHAIN_LINES = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)


def clean_message(text: str) -> str:
    """`text` as one clean line for a client to read: terminal escape codes and control
    characters removed, every traceback reduced to its exception line(s), the lines joined
    with single spaces. The full text belongs in the log, never in a response."""
    text = _ANSI.sub("", text)
    kept: list[str] = []
    in_traceback = False
    for line in text.splitlines():
        stripped = line.strip()
        if _TRACEBACK_HEADER in stripped:
            in_traceback = True
            head = stripped[: stripped.index(_TRACEBACK_HEADER)].strip()
            if head:
                kept.append(head)
            continue
        if in_traceback:
            # Frames and source lines are indented (or blank); the first line that is not
            # is the exception's own "Type: message", which ends the traceback.
            if not stripped or line[:1].isspace() or stripped.startswith("^"):
                continue
            in_traceback = False
        if stripped in _CHAIN_LINES or not stripped:
            continue
        kept.append(stripped)
    return " ".join(_CONTROL.sub(" ", " ".join(kept)).split())
