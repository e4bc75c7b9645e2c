"""A stand-in checker for the compile-pool tests: each check's regex is a script of steps.

Imported by the tests as `v1.structured_output.pool_checkers`, a name the spawned supervisor
can import too (the checker is pickled by reference).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from vllm.exceptions import GrammarCompileError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backends.auto import CompileClock


@dataclasses.dataclass
class ScriptChecker:
    """Runs the steps in each check's `regex`, separated by ";":

    `pid=PATH` writes the worker's pid to PATH; `sleep=S` sleeps S seconds; `build=S` sleeps S
    seconds with the clock paused, as building a backend does; `bad=MSG` raises
    GrammarCompileError; `boom` raises RuntimeError; `crash` exits the worker; `ok` does nothing.
    `prepare_error` makes the supervisor's preparation fail, `start_error` every worker's start.
    """

    prepare_error: str | None = None
    start_error: str | None = None

    def prepare(self) -> None:
        if self.prepare_error is not None:
            raise OSError(self.prepare_error)

    def start_worker(self) -> None:
        if self.start_error is not None:
            raise OSError(self.start_error)

    def check(self, params: StructuredOutputsParams, clock: CompileClock) -> None:
        for step in params.regex.split(";"):
            op, _, arg = step.partition("=")
            if op == "pid":
                Path(arg).write_text(str(os.getpid()))
            elif op == "sleep":
                time.sleep(float(arg))
            elif op == "build":
                clock.pause()
                time.sleep(float(arg))
                clock.resume()
            elif op == "bad":
                raise GrammarCompileError("structured_outputs.regex", arg)
            elif op == "boom":
                raise RuntimeError("boom")
            elif op == "crash":
                os._exit(3)
