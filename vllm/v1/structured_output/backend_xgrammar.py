"""Upstream's import path of `has_xgrammar_unsupported_json_features`: code written for vLLM
(its structured-output benchmark among it) imports the check from here. The backend itself
lives in backends/xgrammar.py."""

from __future__ import annotations

from vllm.v1.structured_output.backends.xgrammar import has_xgrammar_unsupported_json_features

__all__ = ["has_xgrammar_unsupported_json_features"]
