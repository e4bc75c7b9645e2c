"""The batch queue: the batches the engine keeps in flight (docs/architecture.md §4).

Under async scheduling (and, with pipeline stages, one batch per stage) the engine core
launches a batch's forward pass before older batches have been sampled and given to
`update_from_output`. `BatchQueue` holds one `InFlightBatch` per such batch, oldest first,
and decides when to schedule, when to issue sampling and when to wait. Its depth is the
executor's `max_concurrent_batches`.

Invariants (the rest of the engine relies on these; the tests in
tests/v1/engine/test_batch_queue.py check each by event order):

1. **No needless waits.** The queue never waits on a batch while it has room and the
   scheduler has work it can schedule. It waits only when it is full, or when `schedule()`
   just produced an empty step.
2. **Batch order and grammar order.** `sample_tokens` calls are issued in batch order (the
   runner samples its executed-but-unsampled steps first in, first out), and outputs go to
   `update_from_output` in batch order. The bitmask rule below keeps every grammar advancing
   exactly as in the synchronous engine.
3. **A deferred batch blocks only its own sampling** (and, through batch order, the sampling
   of newer batches). Newer batches are still scheduled and their forwards still launched.
   Only the requests that sample in a batch whose `sample_tokens` has not been issued wait:
   their next input token is that sample, and it is not on the device yet (see
   `Scheduler.sampling_issued`).
4. **Placeholders per batch.** A request that samples in several in-flight batches holds
   output placeholders for each (`AsyncScheduler`): one, plus the batch's drafts for it. They
   are released when that batch's output reaches `update_from_output`, and a token for a
   request that has finished since (even if a new request took its id) is dropped there.

**When a batch's bitmask may be computed.** Only once no batch older than it can still
advance one of its grammars. A batch scheduled with `pending_structured_output_tokens`
false qualifies at once: none of its structured requests has a token in flight, and none can
be scheduled again before this batch is sampled. Any other batch qualifies when every older
batch has been through `update_from_output`, that is, when it is the oldest batch in the
queue. The bitmask is computed right before the batch's `sample_tokens` is issued
(`BatchQueue._issue_samples` is the only place that does it), so a batch that qualifies still
waits behind an older one that does not.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.executor.abstract import Executor


def resolve_output(output: ModelRunnerOutput | AsyncModelRunnerOutput) -> ModelRunnerOutput:
    """Waits for an async output's host copy, if it is one."""
    if isinstance(output, AsyncModelRunnerOutput):
        return output.get_output()
    return output


@dataclass
class InFlightBatch:
    """One batch from the launch of its forward pass until its `update_from_output`."""

    # The step as scheduled.
    scheduler_output: SchedulerOutput
    # execute_model's future. Workers run calls in order, so once the sample future is done
    # this one is too; it is checked only to raise a forward-pass error.
    exec_future: Future
    # sample_tokens' future; None while the batch is deferred (its sampling not issued yet).
    sample_future: Future | None = None

    @property
    def deferred(self) -> bool:
        """True while this batch's sample_tokens has not been issued."""
        return self.sample_future is None

    @property
    def needs_older_updates(self) -> bool:
        """True when a structured request of this batch had a token in flight when it was
        scheduled: its bitmask must wait until every older batch has been updated."""
        return self.scheduler_output.pending_structured_output_tokens


class BatchQueue:
    """The engine core's in-flight batches and the overlapped loop over them (see the module
    docstring for the invariants and the bitmask rule)."""

    def __init__(self, scheduler: Scheduler, executor: Executor, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"batch queue depth must be at least 1, got {depth}")
        self.scheduler = scheduler
        self.executor = executor
        self.depth = depth
        # Oldest first: index 0 is the next batch to be updated.
        self._batches: deque[InFlightBatch] = deque()

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[InFlightBatch]:
        """The in-flight batches, oldest first."""
        return iter(self._batches)

    @property
    def oldest(self) -> InFlightBatch:
        return self._batches[0]

    @property
    def newest(self) -> InFlightBatch:
        return self._batches[-1]

    @property
    def has_room(self) -> bool:
        return len(self._batches) < self.depth

    def step(self) -> tuple[list[EngineCoreOutput] | None, bool]:
        """One call of the overlapped loop. Returns (outputs, whether a model step ran);
        outputs is None when the call only launched a batch.

        If the queue has room and requests are unfinished, it schedules a batch and launches
        it; while the queue still has room afterwards it returns at once, so the next call
        schedules again (invariant 1). Otherwise (queue full, or nothing schedulable now) it
        waits for the oldest batch, updates the scheduler with its output, and issues the
        sampling that update has unblocked.
        """
        scheduler = self.scheduler
        launched = False
        if self.has_room and scheduler.has_unfinished_requests():
            scheduler_output = scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens > 0:
                self.launch(scheduler_output)
                launched = True
                if self.has_room and scheduler.has_unfinished_requests():
                    return None, True
            else:
                # Nothing to run now (every request is waiting, finished, or waits for a
                # sample that is not issued yet): its news goes with the next step.
                scheduler.unschedule(scheduler_output)
        if not self._batches:
            return scheduler.take_pending_outputs() or None, launched
        return self.finish_oldest(), True

    def launch(self, scheduler_output: SchedulerOutput) -> InFlightBatch:
        """Launches a scheduled step's forward pass and, if the bitmask rule allows it now,
        its sampling right behind it (the bitmask is then computed while the forward runs)."""
        exec_future = self.executor.execute_model(scheduler_output, non_block=True)
        assert exec_future is not None
        batch = InFlightBatch(scheduler_output, exec_future)
        self._batches.append(batch)
        self._issue_samples()
        return batch

    def finish_oldest(self) -> list[EngineCoreOutput]:
        """Waits for the oldest batch's sample, gives it to update_from_output, and then issues
        the sampling of newer batches that this update unblocked."""
        batch = self._batches.popleft()
        # _issue_samples always issues the oldest batch's sampling (nothing older can hold it).
        assert batch.sample_future is not None, "the oldest in-flight batch was never sampled"
        try:
            raw = batch.sample_future.result()
        except BaseException:
            batch.exec_future.result()  # a failed forward is the cause: raise its error
            raise
        batch.exec_future.result()  # done already; raises a forward-pass error
        outputs = self.scheduler.update_from_output(
            batch.scheduler_output, resolve_output(raw)
        )
        self._issue_samples()
        return outputs

    def _issue_samples(self) -> None:
        """Issues sample_tokens, in batch order, for every deferred batch that the bitmask rule
        (module docstring) now allows; stops at the first one it does not.

        This is the only place a bitmask is computed in the overlapped loop.
        """
        for position, batch in enumerate(self._batches):
            if not batch.deferred:
                continue
            if batch.needs_older_updates and position > 0:
                # An older batch may still advance one of its grammars. Newer batches wait
                # behind it: sampling is in batch order.
                return
            scheduler_output = batch.scheduler_output
            grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
            batch.sample_future = self.executor.sample_tokens(grammar_output, non_block=True)
            # From here on every forward runs after this sampling in the workers' call
            # order, so this batch's requests may be scheduled again (invariant 3).
            self.scheduler.sampling_issued(scheduler_output)
