"""`vllm.platforms.current_platform`: the device this engine runs on, as upstream vLLM
exposes it (`current_platform.is_cuda()`, `.is_cpu()`, `.device_type`)."""

from __future__ import annotations

from functools import cached_property


class Platform:
    """The engine's device: CUDA when torch sees a GPU, else the CPU (the same rule as
    `vllm.config.default_device`). Detected on first use, so importing this module does not
    import torch."""

    @cached_property
    def device_type(self) -> str:
        """"cuda" or "cpu"."""
        from vllm.config import default_device

        return default_device().type

    @property
    def device_name(self) -> str:
        """Same as `device_type` (upstream's platform name)."""
        return self.device_type

    def is_cuda(self) -> bool:
        """Whether the engine runs on an NVIDIA GPU."""
        return self.device_type == "cuda"

    def is_cpu(self) -> bool:
        """Whether the engine runs on the CPU."""
        return self.device_type == "cpu"

    def is_rocm(self) -> bool:
        """Always False: this engine has no ROCm path."""
        return False

    def is_tpu(self) -> bool:
        """Always False: this engine has no TPU path."""
        return False

    def is_xpu(self) -> bool:
        """Always False: this engine has no XPU path."""
        return False

    def is_cuda_alike(self) -> bool:
        """Same as `is_cuda()` (no ROCm here)."""
        return self.is_cuda()

    def get_device_name(self, device_id: int = 0) -> str:
        """The GPU's name on CUDA, else "cpu"."""
        if not self.is_cuda():
            return "cpu"
        import torch

        return torch.cuda.get_device_name(device_id)

    def device_count(self) -> int:
        """Visible GPUs on CUDA; 1 (the CPU) otherwise."""
        if not self.is_cuda():
            return 1
        import torch

        return torch.cuda.device_count()

    def __repr__(self) -> str:
        return f"Platform(device_type={self.device_type!r})"


current_platform = Platform()

__all__ = ["Platform", "current_platform"]
