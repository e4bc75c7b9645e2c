"""Suite-wide setup."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

# Triton kernels run on the CPU only in interpreter mode, which must be chosen before the
# first `import triton` anywhere in the process.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread_per_rank() -> Iterator[None]:
    """Every rank (in this process and in worker processes) runs one OpenMP thread.

    CPU kernels reduce in an order that depends on their thread count, so two layouts
    compute the same numbers only when their ranks run the same number of threads; the
    layouts themselves change no arithmetic.
    """
    import torch

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
