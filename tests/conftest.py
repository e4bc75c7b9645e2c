"""Suite-wide setup."""

from __future__ import annotations

import os
import shutil

# Triton kernels run on the CPU only in interpreter mode, which must be chosen before the
# first `import triton` anywhere in the process.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
