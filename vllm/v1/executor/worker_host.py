"""One rank's Worker as an executor hosts it outside the engine process: in a worker process
(mp) or a Ray actor (ray). Both build it and answer calls here, in typed messages."""

from __future__ import annotations

import os
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.executor import worker_messages
from vllm.v1.executor.worker_messages import Call, Failure, Frame, MessageDecodeError, Ready
from vllm.v1.executor.worker_messages import RemoteError, Result
from vllm.v1.outputs import AsyncModelRunnerOutput


class WorkerHost:
    """Builds one rank's Worker and answers the executor's Calls on it, in arrival order.

    Only the output rank answers a call that is not `reply_all`; a failure always answers.
    Replies are sent as `encode` frames them.
    """

    def __init__(self, rank: int, world_size: int, local_rank: int, output_rank: int) -> None:
        self.rank = rank
        self.output_rank = output_rank
        self.worker: Any = None
        # torch.distributed and the device selection read these.
        os.environ["RANK"] = str(rank)
        os.environ["LOCAL_RANK"] = str(local_rank)
        os.environ["WORLD_SIZE"] = str(world_size)

    def start(self, vllm_config: VllmConfig, init_method: str) -> Ready | Failure:
        """Builds the Worker (choosing its device and joining the world over `init_method`;
        every rank must start at the same time) and loads the model. Returns Ready, or the
        startup Failure (call_id None) carrying what building or loading raised."""
        try:
            from vllm.v1.worker.gpu_worker import Worker

            self.worker = Worker(vllm_config, self.rank, init_method)
            self.worker.load_model()
        except Exception as exc:
            return self.fail(None, exc)
        return Ready(self.rank, os.getpid())

    def answer(self, call: Call) -> Result | Failure | None:
        """Runs `call` on the Worker. Returns its Result when this rank must reply, its
        Failure when it raised, else None. An async model output stays unfinished until
        `encode`."""
        try:
            result = call.run(self.worker)
        except Exception as exc:
            return self.fail(call.call_id, exc)
        if call.reply_all or self.rank == self.output_rank:
            return Result(call.call_id, self.rank, result)
        return None

    def reject(self, error: MessageDecodeError) -> Failure:
        """The Failure of a call whose frames did not decode (an unknown method, arguments
        that do not unpickle). Re-raises `error` when it names no call to answer."""
        if error.call_id is None:
            raise error
        return self.fail(error.call_id, error.error)

    def fail(self, call_id: int | None, exc: BaseException) -> Failure:
        """The Failure of call `call_id` (None: of the startup) that raised `exc`."""
        return Failure(call_id, self.rank, RemoteError.capture(exc))

    def encode(self, reply: Ready | Result | Failure) -> list[Frame]:
        """The frames of `reply`, ready to leave this process: an async model output's
        device-to-host copy is awaited first, and a Result that cannot be sent (its copy or
        its pickling raised) becomes the Failure of its call."""
        if isinstance(reply, Result) and isinstance(reply.value, AsyncModelRunnerOutput):
            try:
                reply = Result(reply.call_id, self.rank, reply.value.get_output())
            except Exception as exc:
                reply = self.fail(reply.call_id, exc)
        try:
            return worker_messages.encode(reply)
        except Exception as exc:
            # Only a Result's value can fail to pickle: the caller gets that error instead.
            if not isinstance(reply, Result):
                raise
            return worker_messages.encode(self.fail(reply.call_id, exc))

    def close(self) -> None:
        """Leaves the distributed world. Idempotent."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
