"""Train an EAGLE-3 draft head for a target by self-distillation.

    .venv/bin/python benchmarks/train_eagle3.py --out results/eagle3-smollm2 \
        [--model MODEL] [--num-prompts 256] [--output-len 192] [--steps 2000] [--lr 3e-4] \
        [--draft-vocab 8192] [--ttt-steps 3] [--aux-layers 2,15,27] [--seed 0]

then serve with `--speculative-config '{"method": "eagle3", "model": OUT}'`.

1. *Data*: the target (the engine, temperature 0.8) answers `--num-prompts` chat prompts,
   so the head learns the target's distribution on the target's own text.
2. *Target states*: one forward of the target (the engine's model class) per sequence gives
   the residual stream entering the auxiliary layers and the target's logits at every
   position; the draft vocabulary is the `--draft-vocab` most frequent tokens of the data.
3. *Training*: the engine's own head module (model_executor/models/eagle3_head.py), its
   attention swapped for a dense one that does EAGLE-3's test-time training: step 0 reads
   the target's states at every position; step s feeds back the head's own hidden state
   of step s - 1 with the next token of the text, attending to step 0's keys up to its
   position and to its own earlier steps' keys at that position (what drafting s tokens
   ahead sees). The loss is the cross-entropy against the target's distribution over the
   draft vocabulary, step s weighted 0.8^s. The LM head starts as the target's rows, the
   final norm as the target's; the token embedding is the target's (not trained, not saved).
4. *Output*: the original EAGLE-3 layout (config.json, model.safetensors with fc, midlayer,
   norm, lm_head, d2t, t2d), which the engine reads (transformers_utils/eagle3_config.py).

Default `--model`: the engine's default (SmolLM2-135M-Instruct), auxiliary layers upstream's
choice 2, L // 2, L - 3. A model of under five layers takes 0, L // 2, L.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

TOPICS = ["the ocean", "a small village", "quantum computers", "green tea", "a robot",
          "jazz", "honey bees", "the moon", "bread", "trains", "volcanoes", "chess"]
ASKS = ["Write a short story about {}.", "Explain {} to a child.", "List three facts about {}.",
        "Give me a JSON object describing {}.", "Write a poem about {}.",
        "What are the pros and cons of {}?", "Summarise the history of {} in a paragraph."]


def prompts(n: int, seed: int) -> list[list[dict[str, str]]]:
    """n one-message chat conversations."""
    rng = random.Random(seed)
    return [[{"role": "user", "content": rng.choice(ASKS).format(rng.choice(TOPICS))}]
            for _ in range(n)]


def generate_data(model: str | None, num_prompts: int, output_len: int,
                  seed: int) -> list[list[int]]:
    """The target's own conversations: prompt and sampled reply token ids, one list each."""
    from vllm import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=max(1, min(num_prompts, 64)))
    try:
        params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=output_len,
                                 seed=seed + i) for i in range(num_prompts)]
        outs = llm.chat(prompts(num_prompts, seed), params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


def default_aux_layers(num_layers: int) -> list[int]:
    """Upstream's choice (2, L // 2, L - 3), or 0, L // 2, L for a model under five layers."""
    if num_layers >= 5:
        return [2, num_layers // 2, num_layers - 3]
    return [0, num_layers // 2, num_layers]


def load_target(config: Any, aux_layers: list[int], max_tokens: int):
    """The target's engine model for its ModelConfig, keeping its auxiliary hidden states
    (set_aux_layers)."""
    from vllm.model_executor.model_loader.loader import get_model

    target = get_model(config)
    target.model.set_aux_layers(tuple(aux_layers), max_tokens)
    return target


@torch.no_grad()
def target_states(target, tokens: list[int], block_size: int = 16
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through the target: (auxiliary states [T, n_aux * hidden], logits
    [T, vocab]) in float32 on the target's device."""
    from vllm.attention.backends.abstract import AttentionMetadata

    device = target.lm_head.weight.device
    n = len(tokens)
    blocks = -(-n // block_size)
    shape = target.attn_backend_cls.kv_cache_shape(blocks, block_size, target.num_kv_heads,
                                                   target.head_dim)
    caches = [torch.zeros(shape, dtype=target.lm_head.weight.dtype, device=device)
              for _ in range(target.num_layers)]
    cu = torch.tensor([0, n], dtype=torch.int32)
    seq = torch.tensor([n], dtype=torch.int32)
    positions = torch.arange(n, device=device)
    metadata = AttentionMetadata(
        num_actual_tokens=n, num_reqs=1, max_query_len=n, max_seq_len=n,
        query_start_loc=cu.to(device), seq_lens=seq.to(device),
        block_table=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=positions.clone(), query_start_loc_cpu=cu, seq_lens_cpu=seq)
    hidden = target(torch.tensor(tokens, device=device), positions, caches, metadata)
    aux = target.model.aux_hidden[:n].float().clone()
    return aux, target.compute_logits(hidden).float()


def draft_vocabulary(sequences: list[list[int]], size: int, vocab: int) -> list[int]:
    """The `size` most frequent tokens of the data (then the lowest ids), in id order."""
    counts = Counter(t for seq in sequences for t in seq)
    ranked = sorted(range(vocab), key=lambda t: (-counts.get(t, 0), t))
    return sorted(ranked[: min(size, vocab)])


class DenseTestTimeAttention:
    """The head's attention for training, in place of a paged backend: step 0 attends
    causally over the sequence, step s also to each position's own keys of steps 1..s
    (module docstring). `reset` before each sequence; one call per test-time step."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        self.num_heads, self.num_kv_heads, self.scale = num_heads, num_kv_heads, scale
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def reset(self) -> None:
        self.keys, self.values = [], []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
                metadata: Any) -> torch.Tensor:
        """q [T, heads, d], k and v [T, kv_heads, d] -> [T, heads, d]."""
        rep = self.num_heads // self.num_kv_heads
        self.keys.append(k.repeat_interleave(rep, dim=1))
        self.values.append(v.repeat_interleave(rep, dim=1))
        n = q.shape[0]
        base = torch.einsum("ihd,jhd->hij", q, self.keys[0]) * self.scale
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        base = base.masked_fill(~causal, float("-inf"))
        own = [(q * key).sum(-1).transpose(0, 1)[:, :, None] * self.scale
               for key in self.keys[1:]]  # [heads, T, 1] each
        weights = torch.softmax(torch.cat([base, *own], dim=-1), dim=-1)
        out = torch.einsum("hij,jhd->ihd", weights[:, :, :n], self.values[0])
        for s, value in enumerate(self.values[1:]):
            out = out + weights[:, :, n + s].transpose(0, 1)[:, :, None] * value
        return out


def new_head(target, target_config: Any, vocab: list[int], aux_layers: list[int],
             out: Path, seed: int, max_position: int):
    """A one-layer head for the target (its attention shape, MLP width and RoPE), LM head
    and final norm copied from the target, the rest small random values, in float32."""
    from vllm.model_executor.layers.rotary_embedding import rope_parameters
    from vllm.model_executor.models.eagle3_head import Eagle3Head
    from vllm.transformers_utils.eagle3_config import Eagle3HeadConfig

    c = target_config
    heads = c.num_attention_heads
    config = Eagle3HeadConfig(
        model_dir=out, layout="eagle3", model_type="llama", hidden_size=c.hidden_size,
        num_layers=1, num_heads=heads, num_kv_heads=getattr(c, "num_key_value_heads", heads),
        head_dim=target.head_dim, intermediate_size=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps, rope=rope_parameters(c), attention_bias=False,
        mlp_bias=False, vocab_size=c.vocab_size, draft_vocab_size=len(vocab),
        aux_layer_ids=tuple(aux_layers))
    device = target.lm_head.weight.device
    torch.manual_seed(seed)
    head = Eagle3Head(config, DenseTestTimeAttention, max_position, target.model.embed_tokens)
    head = head.to(device=device, dtype=torch.float32)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        head.lm_head.weight.copy_(target.lm_head.weight[torch.tensor(vocab, device=device)])
        head.norm.weight.copy_(target.model.norm.weight)
        head.d2t_ids.copy_(torch.tensor(vocab))
    return head


def ttt_loss(head, aux: torch.Tensor, tokens: torch.Tensor, target_logprobs: torch.Tensor,
             steps: int, decay: float = 0.8) -> tuple[torch.Tensor, float]:
    """The test-time-training loss over one sequence, and step 0's top-1 agreement with
    the target: `target_logprobs` [T, draft vocab] are the target's log-probabilities over
    the draft vocabulary at each position (of the token after it)."""
    for layer in head.layers:
        layer.self_attn.attn.reset()
    n = len(tokens) - 1  # position i reads token i + 1
    positions = torch.arange(n, device=aux.device)
    hidden = head.combine(aux[:n])
    # Step s feeds token i + 1 + s at index i: past the text's end, padding (as speculators
    # does), whose outputs no loss reads.
    padded = torch.cat([tokens, tokens.new_zeros(steps)])
    total = aux.new_zeros(())
    agree = 0.0
    for s in range(steps):
        valid = n - 1 - s  # index i predicts the token after position i + 1 + s
        if valid <= 0:
            break
        out = head(padded[1 + s : 1 + s + n], hidden, positions + s,
                   [None] * head.num_layers, None)
        logprobs = torch.log_softmax(head.compute_logits(out[:valid]), dim=-1)
        want = target_logprobs[1 + s : 1 + s + valid]
        total = total + decay**s * -(want.exp() * logprobs).sum(-1).mean()
        if s == 0:
            agree = float((logprobs.argmax(-1) == want.argmax(-1)).float().mean())
        hidden = head.carry(out)
    return total, agree


def train(head, data: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], steps: int,
          lr: float, ttt_steps: int, log_every: int = 50) -> list[float]:
    """AdamW with a cosine decay over `steps` steps, one sequence per step (cycling through
    `data`: (aux, tokens, target log-probs)); returns each step's loss."""
    trainable = [p for n, p in head.named_parameters() if not n.startswith("embed")]
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / max(steps, 1)))
        aux, tokens, target_logprobs = data[step % len(data)]
        loss, agree = ttt_loss(head, aux, tokens, target_logprobs, ttt_steps)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:5d}  loss {losses[-1]:.4f}  top-1 agreement {agree:.3f}  "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    return losses


def save_head(head, out: Path, vocab: list[int], target_config: Any) -> None:
    """Writes the head in the original EAGLE-3 layout (config.json, model.safetensors)."""
    from safetensors.torch import save_file

    config = head.config
    tensors = {}
    for name, p in head.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        tensors[name.replace("layers.0.", "midlayer.")] = p.detach().float().cpu().contiguous()
    ids = torch.tensor(vocab, dtype=torch.int64)
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["d2t"] = ids - torch.arange(len(vocab))
    tensors["t2d"] = t2d
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": config.rms_norm_eps, "rope_scaling": config.rope,
        "rope_theta": config.rope["rope_theta"],
        "max_position_embeddings": getattr(target_config, "max_position_embeddings", 2048),
        "vocab_size": config.vocab_size, "draft_vocab_size": len(vocab),
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids)},
    }, indent=2))


def run(args: argparse.Namespace) -> list[float]:
    """The whole pipeline (module docstring); returns the training losses."""
    t0 = time.perf_counter()
    sequences = generate_data(args.model, args.num_prompts, args.output_len, args.seed)
    print(f"{len(sequences)} sequences, {sum(map(len, sequences))} tokens "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    from vllm.engine.arg_utils import EngineArgs

    longest = max(map(len, sequences))
    model_config = EngineArgs(model=args.model).create_engine_config().model_config
    hf = model_config.hf_config
    aux_layers = ([int(x) for x in args.aux_layers.split(",")] if args.aux_layers
                  else default_aux_layers(hf.num_hidden_layers))
    target = load_target(model_config, aux_layers, longest)
    vocab = draft_vocabulary(sequences, args.draft_vocab, hf.vocab_size)
    index = torch.tensor(vocab, device=target.lm_head.weight.device)
    data = []
    for seq in sequences:
        aux, logits = target_states(target, seq)
        tokens = torch.tensor(seq, device=aux.device)
        data.append((aux, tokens, torch.log_softmax(logits[:, index], dim=-1)))
    print(f"target states of aux layers {aux_layers} ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    head = new_head(target, hf, vocab, aux_layers, args.out, args.seed,
                    longest + args.ttt_steps)
    losses = train(head, data, args.steps, args.lr, args.ttt_steps)
    save_head(head, args.out, vocab, hf)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return losses


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="target (default: the engine's)")
    parser.add_argument("--out", type=Path, required=True, help="the head's directory")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=192)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--aux-layers", default=None,
                        help="comma-separated target layers (default: 2,L/2,L-3)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse())
