"""Helpers for the tensor- and pipeline-parallel model tests: tiny checkpoints with config
overrides, building a rank's model, and a fixed paged workload run through a stack of
pipeline stages. Importable by spawned ranks (it holds the functions they run)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.utils_attention import ReqStep, allocate_blocks, make_metadata
from tests.utils_models import hf_config, randomize
from vllm.config import ModelConfig, default_device
from vllm.distributed.parallel_state import ParallelContext, ParallelLayout
from vllm.model_executor.model_loader.loader import get_model

# A prefill of three prompts (one of a single token) with padding, then two decode steps.
PROMPT_LENS = [5, 9, 1]
DECODE_STEPS = 2
BLOCK_SIZE = 4
PAD = 2


def build_tiny(name: str, path: Path, seed: int, **overrides: Any) -> Path:
    """Saves a random tiny checkpoint of architecture `name` (see tests/utils_models.py) with
    config fields overridden; returns path."""
    from transformers import AutoModelForCausalLM

    fields = hf_config(name).to_dict()
    fields.update(overrides)
    fields.pop("layer_types", None)  # derived from num_hidden_layers; rebuilt by the config
    config = type(hf_config(name)).from_dict(fields)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize(hf, seed)
    hf.save_pretrained(path)
    return path


def load(path: Path, parallel: ParallelContext | None = None, **kwargs: Any) -> nn.Module:
    """This rank's float32 model (torch attention) from a checkpoint directory."""
    config = ModelConfig(model=str(path), dtype="float32", attention_backend="torch", **kwargs)
    return get_model(config, parallel)


def pp_context(pp_size: int, rank: int) -> ParallelContext:
    """A single-process context for one stage of a tp=1 pipeline (no collectives needed)."""
    return ParallelContext(ParallelLayout(pp_size=pp_size, rank=rank))


def _sequences(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(n + DECODE_STEPS)] for n in PROMPT_LENS]


def _kv_caches(
    model: nn.Module, num_blocks: int, first_layer: int, device: torch.device
) -> list[torch.Tensor]:
    # Garbage that depends only on the global layer index: stages of a pipeline get exactly
    # the caches the whole model gets, and reading an unwritten slot would show.
    shape = model.attn_backend_cls.kv_cache_shape(
        num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim
    )
    caches = []
    for i in range(first_layer, first_layer + model.num_layers):
        gen = torch.Generator().manual_seed(1000 + i)
        caches.append(torch.randn(shape, generator=gen).to(device))
    return caches


def run_workload(stages: list[nn.Module]) -> torch.Tensor:
    """Runs the fixed workload through pipeline stages in order (one model: no pipeline) and
    returns the logits of every real token of every step, concatenated [N, vocab]."""
    vocab_size = stages[-1].vocab_size
    device = next(stages[-1].parameters()).device
    seqs = _sequences(vocab_size)
    block_ids, num_blocks = allocate_blocks(
        [len(s) for s in seqs], BLOCK_SIZE, random.Random(1)
    )
    caches, first = [], 0
    for model in stages:
        caches.append(_kv_caches(model, num_blocks, first, device))
        first += model.num_layers
    done = [0] * len(seqs)
    plan = [(dict(enumerate(PROMPT_LENS)), PAD)]
    plan += [({i: 1 for i in range(len(seqs))}, 0)] * DECODE_STEPS
    out = []
    for num_new, pad in plan:
        steps = [ReqStep(done[i], n, block_ids[i]) for i, n in num_new.items()]
        meta, positions = make_metadata(steps, BLOCK_SIZE, device, pad=pad)
        ids = [t for i, n in num_new.items() for t in seqs[i][done[i] : done[i] + n]]
        input_ids = torch.tensor(ids + [0] * pad, dtype=torch.int64, device=device)
        with torch.inference_mode():
            hidden: Any = None
            for model, stage_caches in zip(stages, caches, strict=True):
                hidden = model(input_ids, positions, stage_caches, meta, intermediate=hidden)
            out.append(stages[-1].compute_logits(hidden[: len(ids)]).cpu())
        for i, n in num_new.items():
            done[i] += n
    return torch.cat(out)


def _w13_rows(model: nn.Module) -> int | None:
    """Rows of the first MoE layer's stacked gate/up expert weights (None: no experts)."""
    for name, param in model.named_parameters():
        if name.endswith("experts.w13_weight"):
            return int(param.shape[1])
    return None


def tp_worker(rank: int, tp_size: int, init_file: str, jobs: list[tuple[str, str, dict]],
              out_dir: str) -> None:
    """One tensor-parallel rank: joins the gloo group, then for each (tag, checkpoint dir,
    ModelConfig kwargs) job builds its shard of the model, runs the workload and saves the
    logits and a few local sizes to out_dir/{tag}.{rank}.pt. Run by
    torch.multiprocessing.spawn."""
    from vllm.distributed.parallel_state import destroy_distributed, init_distributed

    torch.set_num_threads(1)  # the ranks share the machine's few cores
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    layout = ParallelLayout(tp_size=tp_size, rank=rank)
    ctx = init_distributed(layout, f"file://{init_file}", device)
    try:
        for tag, path, kwargs in jobs:
            model = load(Path(path), ctx, **kwargs)
            result = {
                "logits": run_workload([model]),
                "num_kv_heads": model.num_kv_heads,
                "qkv_rows": model.model.layers[0].self_attn.qkv_proj.local_sizes[0],
                "vocab_rows": model.lm_head.weight.shape[0],
                "w13_rows": _w13_rows(model),
            }
            torch.save(result, Path(out_dir) / f"{tag}.{rank}.pt")
    finally:
        destroy_distributed(ctx)
