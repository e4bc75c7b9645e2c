"""The names the engine's options accept: grammar backends, executors, fast-forward modes and
scheduling policies.

The bottom layer (docs/architecture.md section 3): it imports nothing of the engine but its
exception types, so `config/`, `sampling_params.py` and the argument parser check option
values here without reaching up into `v1/`. The classes behind the names are import paths
here and are imported only by the registries in `v1/` (structured_output/backends/registry.py,
executor/registry.py), so reading a name never loads a backend's library.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from vllm.exceptions import InvalidRequestError

# ----------------------------------------------------------------- grammar backends

# Name -> "module:class". Order is preference under "auto": each constraint goes to the
# first backend that enforces it exactly (only the first with `disable_fallback`). A new
# backend is its module plus one line here.
GRAMMAR_BACKENDS: dict[str, str] = {
    "xgrammar": "vllm.v1.structured_output.backends.xgrammar:XgrammarBackend",
    "guidance": "vllm.v1.structured_output.backends.guidance:GuidanceBackend",
    "outlines": "vllm.v1.structured_output.backends.outlines:OutlinesBackend",
    "lm-format-enforcer":
        "vllm.v1.structured_output.backends.lm_format_enforcer:LMFormatEnforcerBackend",
}

# Backends "auto" never picks on its own: everything they enforce, xgrammar or llguidance
# enforces too (and faster). A request may still name them, and a server may select one.
GRAMMAR_ON_REQUEST_ONLY: frozenset[str] = frozenset({"outlines", "lm-format-enforcer"})

# Upstream's names for ours, accepted where a request names its backend.
GRAMMAR_ALIASES: dict[str, str] = {"llguidance": "guidance"}

# The server's default choice: per request, the first backend that enforces it exactly.
AUTO = "auto"


def grammar_server_choices() -> tuple[str, ...]:
    """The values --structured-outputs-config.backend accepts: "auto", then each backend."""
    return (AUTO, *GRAMMAR_BACKENDS)


def grammar_request_names() -> dict[str, str]:
    """The names a request may give its `backend`, each mapped to the backend's own name
    (aliases included; "auto" is not a backend)."""
    return {**{name: name for name in GRAMMAR_BACKENDS}, **GRAMMAR_ALIASES}


# ----------------------------------------------------------------------- executors

class ExecutorEntry(NamedTuple):
    """An executor as the configuration knows it, without importing it (its class carries
    the same two facts as class attributes, for executors passed as a class)."""

    # "module:Class".
    path: str
    # What it runs, for --help.
    help: str
    # The most ranks it can run (None: any number); a larger layout is a configuration error.
    max_world_size: int | None = None
    # True when the ranks run on a cluster's devices, which the executor places itself.
    remote_devices: bool = False


# A new executor adds one line here.
EXECUTORS: dict[str, ExecutorEntry] = {
    "uni": ExecutorEntry("vllm.v1.executor.uniproc_executor:UniProcExecutor",
                         "one worker in the engine process", max_world_size=1),
    "mp": ExecutorEntry("vllm.v1.executor.multiproc_executor:MultiprocExecutor",
                        "one process per rank"),
    "ray": ExecutorEntry("vllm.v1.executor.ray_executor:RayExecutor",
                         "one Ray actor per rank, across a Ray cluster: pip install -e '.[ray]'",
                         remote_devices=True),
}


def executor_names() -> tuple[str, ...]:
    """Every accepted --distributed-executor-backend name, in registry order."""
    return tuple(EXECUTORS)


def describe_executors() -> str:
    """The executors for --help: "uni (...), mp (...) or ray (...)"."""
    parts = [f"{name} ({entry.help})" for name, entry in EXECUTORS.items()]
    return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]


def check_executor_name(name: str) -> ExecutorEntry:
    """The entry of executor `name`. Raises ValueError naming the flag for an unknown one."""
    if name not in EXECUTORS:
        names = executor_names()
        allowed = ", ".join(repr(n) for n in names[:-1]) + f" or {names[-1]!r}"
        raise ValueError(f"--distributed-executor-backend: must be {allowed}, got {name!r}")
    return EXECUTORS[name]


# -------------------------------------------------------------- fast-forward modes

OFF, EXACT, CANONICAL = "off", "exact", "canonical"
# In order of how far a mode departs from free decoding.
FAST_FORWARD_MODES = (OFF, EXACT, CANONICAL)
_RANK = {mode: i for i, mode in enumerate(FAST_FORWARD_MODES)}
# Older spellings of the server option (it was a boolean).
_FAST_FORWARD_ALIASES: dict[Any, str] = {True: EXACT, False: OFF, "true": EXACT, "false": OFF}


def fast_forward_rank(mode: str) -> int:
    """How far `mode` departs from free decoding: off < exact < canonical."""
    return _RANK[mode]


def parse_fast_forward(value: Any, field: str) -> str:
    """`value` as one of FAST_FORWARD_MODES (true/false are accepted as exact/off). Raises
    ValueError naming `field` for anything else."""
    if isinstance(value, bool) or (isinstance(value, str) and value in _FAST_FORWARD_ALIASES):
        return _FAST_FORWARD_ALIASES[value]
    if isinstance(value, str) and value in _RANK:
        return value
    raise ValueError(f"{field}: must be one of {', '.join(FAST_FORWARD_MODES)}, got {value!r}")


def parse_request_fast_forward(value: Any) -> str | None:
    """A request's `structured_outputs.fast_forward` (None: the server's mode). Raises
    InvalidRequestError naming the field for anything but a mode, true or false."""
    if value is None:
        return None
    try:
        return parse_fast_forward(value, "structured_outputs.fast_forward")
    except ValueError as e:
        raise InvalidRequestError(
            "structured_outputs.fast_forward", str(e).split(": ", 1)[1]
        ) from None


# ------------------------------------------------------------- scheduling policies

# --scheduling-policy: "fcfs" admits waiting requests in arrival order and preempts the
# newest running one; "priority" orders both by a request's `priority` (lower first), then
# arrival (vllm/v1/core/sched/request_queue.py).
FCFS = "fcfs"
PRIORITY = "priority"
SCHEDULING_POLICIES = (FCFS, PRIORITY)
