"""How many OpenMP threads an engine process runs, and whether they spin while idle.

The policy is derived from the CPUs this process may run on (`os.sched_getaffinity`) and is
applied where engine processes start, never at import:

- a process that starts engine processes (the mp executor's workers, `vllm serve`'s engine
  core) puts the policy in their environment with `child_env` while it starts them;
- a process that runs the model itself (the offline `LLM`) calls `configure_process` when the
  engine is built, which must happen before torch is imported for the wait policy to apply.

Override: a value set in OMP_NUM_THREADS or OMP_WAIT_POLICY always wins and is passed on to
the engine's processes unchanged (e.g. `OMP_WAIT_POLICY=ACTIVE vllm serve ...`).

Why PASSIVE: after each parallel region, libgomp's idle team threads spin (300000 iterations
by default) before they sleep. When the team has a thread on every CPU the process may use,
that spinning takes the cores the engine's own threads (scheduler, ZMQ I/O, output and
grammar threads) need between two forwards; PASSIVE makes them sleep at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

NUM_THREADS_ENV = "OMP_NUM_THREADS"
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"

# Shared libraries of the OpenMP runtimes torch may load (GNU, Intel, LLVM).
_OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")


def available_cpus() -> int:
    """The number of CPUs this process may run on (its affinity mask, not the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API on this platform
        return os.cpu_count() or 1


def helper_threads() -> int:
    """Threads a CPU-side helper pool (grammar compiles, bitmask fills) may use: half of
    this process's CPUs, at least 2 and at most 8."""
    return max(2, min(8, available_cpus() // 2))


@dataclass(frozen=True)
class ThreadPolicy:
    """OpenMP settings for one of the processes that run the model on this machine."""

    # OpenMP (and torch intra-op) threads of the process.
    num_threads: int
    # OMP_WAIT_POLICY, or None to keep the OpenMP runtime's default.
    wait_policy: str | None

    def env(self) -> dict[str, str]:
        """The policy as environment variables."""
        values = {NUM_THREADS_ENV: str(self.num_threads)}
        if self.wait_policy is not None:
            values[WAIT_POLICY_ENV] = self.wait_policy
        return values


def _leading_int(value: str | None) -> int | None:
    """The first entry of an OMP_NUM_THREADS value ("8" or the nested "8,2"), if valid."""
    if value is None:
        return None
    try:
        number = int(value.split(",")[0])
    except ValueError:
        return None
    return number if number > 0 else None


def derive(
    processes: int = 1, environ: Mapping[str, str] | None = None, cpus: int | None = None
) -> ThreadPolicy:
    """The policy for each of `processes` model-running processes that share this process's
    CPUs (`cpus`, default: `available_cpus()`). Values set in `environ` (default: os.environ)
    are kept."""
    environ = os.environ if environ is None else environ
    cpus = available_cpus() if cpus is None else cpus
    processes = max(1, processes)
    num_threads = _leading_int(environ.get(NUM_THREADS_ENV)) or max(1, cpus // processes)
    wait_policy = environ.get(WAIT_POLICY_ENV)
    # Spinning costs nothing only when every process's team leaves it a CPU of its own for
    # the engine's other threads; otherwise idle team threads must sleep.
    if wait_policy is None and (num_threads + 1) * processes > cpus:
        wait_policy = "PASSIVE"
    return ThreadPolicy(num_threads, wait_policy)


@contextlib.contextmanager
def _scoped_env(values: Mapping[str, str]) -> Iterator[None]:
    """Sets the variables of `values` that os.environ lacks, then removes them again."""
    added = [key for key in values if key not in os.environ]
    for key in added:
        os.environ[key] = values[key]
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextlib.contextmanager
def child_env(processes: int) -> Iterator[ThreadPolicy]:
    """Puts the policy of `processes` model-running processes into os.environ while the block
    starts them, then restores os.environ.

    A spawned process inherits the environment when it starts, and its OpenMP runtime and
    torch read it when they load, so this is the only way to reach them before they do.
    Variables already set (by the user, or by the process that started this one) are kept.
    """
    policy = derive(processes)
    with _scoped_env(policy.env()):
        yield policy


def openmp_loaded() -> bool:
    """True when an OpenMP runtime is already loaded into this process (it has then read
    its environment for good)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:  # no /proc: torch is what loads OpenMP here
        return "torch" in sys.modules
    return any(name in maps for name in _OPENMP_LIBRARIES)


_lock = threading.Lock()
# The policy this process runs with, once configure_process has run.
_configured: ThreadPolicy | None = None


def configure_process(processes: int = 1) -> ThreadPolicy:
    """Applies the policy to this process, which runs the model itself. Idempotent.

    Call it when an engine is built. Before OpenMP is loaded, it loads torch with the policy
    in the environment (restored afterwards, so processes started later derive their own)
    and sets torch's intra-op threads. Once OpenMP is loaded, the wait policy can no longer
    change: it logs a warning if the process runs without it, and only lowers torch's thread
    count if it exceeds the CPUs.
    """
    global _configured
    with _lock:
        if _configured is not None:
            return _configured
        policy = derive(processes)
        user_threads = NUM_THREADS_ENV in os.environ
        if not openmp_loaded():
            with _scoped_env(policy.env()):
                import torch  # loads the OpenMP runtime, which reads its environment now
            if not user_threads:
                # torch would otherwise read OMP_NUM_THREADS (now unset again) at first use.
                torch.set_num_threads(policy.num_threads)
        else:
            import torch

            if policy.wait_policy is not None and os.environ.get(WAIT_POLICY_ENV) is None:
                logger.warning(
                    "OpenMP was loaded before the engine started, so its threads spin while "
                    "idle and can slow the engine down; set %s=%s in the environment (or "
                    "build the engine before importing torch)",
                    WAIT_POLICY_ENV,
                    policy.wait_policy,
                )
            if not user_threads and torch.get_num_threads() > policy.num_threads:
                torch.set_num_threads(policy.num_threads)
        _configured = policy
        return policy
