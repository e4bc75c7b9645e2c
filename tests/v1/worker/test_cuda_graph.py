"""The decode-graph size ladder and padding choice (capture itself needs CUDA)."""

from __future__ import annotations

from vllm.v1.worker.cuda_graph import DecodeGraphs, capture_sizes


def test_capture_sizes_ladder() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(256)[-3:] == [224, 240, 256]


def test_padded_size_uses_only_captured_graphs() -> None:
    graphs = DecodeGraphs(capture_sizes(64))
    assert graphs.padded_size(1) is None  # nothing captured: eager
    graphs.graphs = {size: object() for size in (4, 16, 64)}
    assert graphs.padded_size(1) == 4
    assert graphs.padded_size(5) == 16
    assert graphs.padded_size(64) == 64
    assert graphs.padded_size(65) is None


def test_graphs_are_a_capability_of_the_attention_backend() -> None:
    from vllm.attention.backends.torch_backend import TorchAttentionBackend
    from vllm.attention.backends.triton_backend import TritonAttentionBackend

    # The Triton backend makes no host sync; the torch one plans each step from host lengths.
    assert TritonAttentionBackend.supports_cuda_graphs
    assert not TorchAttentionBackend.supports_cuda_graphs
