"""The scheduler's waiting queue and running order under each --scheduling-policy.

fcfs: waiting requests start in arrival order, and a preempted request goes back to the head
of the queue (it was admitted before everything still waiting). priority: requests go by
(`priority`, arrival time), lower first, both in the queue and in the running list; the
scheduler then schedules running requests in that order and preempts from the end of the
list, so the lowest-priority (then latest) request is always the one preempted.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator

from vllm.options import PRIORITY
from vllm.v1.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    """The order of `request` under the priority policy: lower priority value first, then
    earlier arrival."""
    return request.priority, request.arrival_time


class FCFSWaitingQueue:
    """The waiting requests, first come first served (the fcfs policy)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        """Queues a new request behind every waiting one."""
        self._queue.append(request)

    def requeue(self, request: Request) -> None:
        """Queues a preempted request at the head."""
        self._queue.appendleft(request)

    def restore(self, requests: list[Request]) -> None:
        """Puts back requests taken from the head this step that could not start yet, in
        their order, ahead of the rest."""
        self._queue.extendleft(reversed(requests))

    def peek(self) -> Request:
        """The request admitted next. Raises IndexError when the queue is empty."""
        return self._queue[0]

    def pop(self) -> Request:
        """Removes and returns the head. Raises IndexError when the queue is empty."""
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        """Takes `request` out of the queue. Raises ValueError when it is not queued."""
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __contains__(self, request: object) -> bool:
        return request in self._queue

    def __getitem__(self, index: int) -> Request:
        return self._queue[index]


class PriorityWaitingQueue:
    """The waiting requests in priority_key order (the priority policy); requests whose keys
    are equal (the samples of one request) keep the order they were queued in. Same methods
    as FCFSWaitingQueue."""

    def __init__(self) -> None:
        # Sorted (key, tie-breaker, request) entries; the tie-breaker never lets two
        # entries compare their requests.
        self._entries: list[tuple[tuple[int, float], int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        """Queues a request at its priority_key place."""
        bisect.insort(self._entries, (priority_key(request), next(self._counter), request))

    def requeue(self, request: Request) -> None:
        """Queues a preempted request at its priority_key place."""
        self.add(request)

    def restore(self, requests: list[Request]) -> None:
        """Puts back requests taken from the head this step, each at its place."""
        for request in requests:
            self.add(request)

    def peek(self) -> Request:
        """The request admitted next. Raises IndexError when the queue is empty."""
        return self._entries[0][2]

    def pop(self) -> Request:
        """Removes and returns the head. Raises IndexError when the queue is empty."""
        return self._entries.pop(0)[2]

    def remove(self, request: Request) -> None:
        """Takes `request` out of the queue. Raises ValueError when it is not queued."""
        for i, entry in enumerate(self._entries):
            if entry[2] is request:
                del self._entries[i]
                return
        raise ValueError(f"request {request.request_id} is not waiting")

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in self._entries)

    def __contains__(self, request: object) -> bool:
        return any(entry[2] is request for entry in self._entries)

    def __getitem__(self, index: int) -> Request:
        return self._entries[index][2]


WaitingQueue = FCFSWaitingQueue | PriorityWaitingQueue


def make_waiting_queue(policy: str) -> WaitingQueue:
    """The waiting queue of `policy` ("fcfs" or "priority")."""
    return PriorityWaitingQueue() if policy == PRIORITY else FCFSWaitingQueue()


def add_running(running: list[Request], request: Request, policy: str) -> None:
    """Adds an admitted request to the running list: last under fcfs (admission order),
    at its priority_key place under priority (after running requests of the same key)."""
    if policy == PRIORITY:
        bisect.insort(running, request, key=priority_key)
    else:
        running.append(request)

