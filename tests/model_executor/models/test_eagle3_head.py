"""Oracle for vllm/model_executor/models/eagle3_head.py: the speculators package's own EAGLE-3
forward.

The speculators package (0.9.0, installed by scripts/setup.sh beside the venv) builds a tiny
random head for a tiny random Llama target and writes it with save_pretrained; the engine reads
that directory (vllm/transformers_utils/eagle3_config.py) and builds its head. For the same
auxiliary hidden states and tokens, the logits of every position and of two further drafting
steps (speculators' test-time-training steps, fed the same tokens) must match within 1e-5 in
float32, and so must the top-1 drafts. Variants: Llama and Qwen3 layers, one and two layers,
norm_before_residual, fc_norm, norm_before_fc, norm_output.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.utils_models import build_checkpoint
from vllm.attention.backends.abstract import AttentionMetadata
from vllm.attention.backends.torch_backend import TorchAttentionBackend
from vllm.model_executor.models.eagle3_head import Eagle3Head
from vllm.transformers_utils.eagle3_config import read_eagle3_head

TOLERANCE = 1e-5
LENGTH = 12
DRAFT_VOCAB = 128
STEPS = 3


@pytest.fixture(scope="module")
def speculators():
    """The speculators package, imported from where scripts/setup.sh installs it (its
    training-data modules' imports of `datasets` and `hs_connectors`, which it was installed
    without, are stubbed; the model classes do not use them)."""
    where = Path(sys.prefix) / "speculators"
    if not (where / "speculators").is_dir():
        pytest.fail(f"the speculators package is not installed in {where}: run scripts/setup.sh")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(where))
        for name, attrs in {"datasets": ("load_from_disk",),
                            "hs_connectors": ("FileTransfer", "HiddenStatesTransfer")}.items():
            if importlib.util.find_spec(name) is None:
                stub = types.ModuleType(name)
                for attr in attrs:
                    setattr(stub, attr, object)
                mp.setitem(sys.modules, name, stub)
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
        from speculators.proposals.greedy import GreedyTokenProposalConfig

        yield types.SimpleNamespace(
            SpeculatorsConfig=SpeculatorsConfig, VerifierConfig=VerifierConfig,
            Eagle3DraftModel=Eagle3DraftModel, Eagle3SpeculatorConfig=Eagle3SpeculatorConfig,
            GreedyTokenProposalConfig=GreedyTokenProposalConfig)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle3_target")
    return path, build_checkpoint("llama", path, seed=3).config


def _write_head(spec, target_dir: Path, target_config, path: Path, layer_type: str,
                num_layers: int, seed: int, **switches) -> Path:
    """A random head written by the speculators package (its own save_pretrained)."""
    from transformers import LlamaConfig, Qwen3Config

    fields = {k: v for k, v in target_config.to_dict().items()
              if k in ("vocab_size", "hidden_size", "intermediate_size",
                       "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                       "rms_norm_eps")}
    layer_cls = LlamaConfig if layer_type == "llama" else Qwen3Config
    layer = layer_cls(**fields, num_hidden_layers=num_layers, head_dim=16)
    layer._attn_implementation = "eager"
    config = spec.Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT_VOCAB,
        eagle_aux_hidden_state_layer_ids=[0, 1, 2], **switches,
        speculators_config=spec.SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[spec.GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            verifier=spec.VerifierConfig(name_or_path=str(target_dir),
                                         architectures=["LlamaForCausalLM"])))
    model = spec.Eagle3DraftModel(config)
    gen = torch.Generator().manual_seed(seed)
    t2d = torch.zeros(fields["vocab_size"], dtype=torch.bool)
    t2d[torch.randperm(fields["vocab_size"], generator=gen)[:DRAFT_VOCAB]] = True
    model.load_vocab_mappings(t2d, t2d.nonzero().squeeze(1) - torch.arange(DRAFT_VOCAB))
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else noise / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return path


def _reference(spec, path: Path, aux: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    """speculators' logits of each test-time-training step ([LENGTH, DRAFT_VOCAB] each): step
    s at index i drafts after the tokens up to i + 1 + s, fed those tokens (teacher forcing)."""
    config = spec.Eagle3SpeculatorConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"
    model = spec.Eagle3DraftModel.from_pretrained(path, config=config).eval()
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o[0].detach()))
    with torch.no_grad():
        model(aux[None], ids[None], torch.zeros(1, LENGTH, dtype=torch.long),
              position_ids=torch.arange(LENGTH)[None], ttt_steps=STEPS)
    hook.remove()
    return logits


def _metadata(positions: torch.Tensor, seq_len: int) -> AttentionMetadata:
    n = len(positions)
    cu = torch.tensor([0, n], dtype=torch.int32)
    seq = torch.tensor([seq_len], dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=n, num_reqs=1, max_query_len=n, max_seq_len=seq_len,
        query_start_loc=cu, seq_lens=seq, block_table=torch.arange(4, dtype=torch.int32)[None],
        slot_mapping=positions.clone(), query_start_loc_cpu=cu, seq_lens_cpu=seq)


@pytest.mark.parametrize("layer_type, num_layers, switches", [
    ("llama", 1, {}),
    ("llama", 2, {"norm_before_residual": True, "fc_norm": True}),
    ("qwen3", 1, {"norm_before_fc": True, "norm_output": True}),
])
def test_logits_match_speculators_forward(speculators, target, tmp_path, layer_type,
                                          num_layers, switches) -> None:
    target_dir, target_config = target
    path = _write_head(speculators, target_dir, target_config, tmp_path / "head", layer_type,
                       num_layers, seed=num_layers, **switches)
    config = read_eagle3_head(path, target_config)
    assert config.layout == "speculators" and config.aux_layer_ids == (0, 1, 2)
    assert config.has_embedding and config.num_layers == num_layers
    head = Eagle3Head(config, TorchAttentionBackend, 64)
    head.load_weights()
    gen = torch.Generator().manual_seed(7)
    aux = torch.randn(LENGTH, 3 * target_config.hidden_size, generator=gen)
    ids = torch.randint(0, target_config.vocab_size, (LENGTH,), generator=gen)
    want = _reference(speculators, path, aux, ids)
    caches = [torch.zeros(TorchAttentionBackend.kv_cache_shape(4, 16, 2, 16))
              for _ in range(num_layers)]
    positions = torch.arange(LENGTH)
    with torch.no_grad():
        out = head(ids, head.combine(aux), positions, caches, _metadata(positions, LENGTH))
        logits = head.compute_logits(out)
        assert (logits - want[0]).abs().max() < TOLERANCE
        assert torch.equal(logits.argmax(-1), want[0].argmax(-1))
        # Drafting after position i: the head's own hidden state, one position on, fed the
        # token speculators fed its step s (teacher forcing).
        for i in (0, 5, LENGTH - STEPS):
            step_caches = [c.clone() for c in caches]
            hidden = head.carry(out[i : i + 1])
            for s in range(1, STEPS):
                position = torch.tensor([i + s])
                x = head(ids[i + s : i + s + 1], hidden, position, step_caches,
                         _metadata(position, i + s + 1))
                got = head.compute_logits(x)[0]
                assert (got - want[s][i]).abs().max() < TOLERANCE, (i, s)
                assert int(got.argmax()) == int(want[s][i].argmax()), (i, s)
                hidden = head.carry(x)
    # Draft id d is target id d + d2t[d]: the d-th token t2d marks.
    d2t = config.draft_to_target()
    targets = torch.nonzero(_t2d(path)).squeeze(1)
    assert torch.equal(d2t, targets)


def _t2d(path: Path) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return f.get_tensor("t2d")
