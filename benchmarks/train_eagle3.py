"""Train an EAGLE-3 draft head for a target by self-distillation.

    .venv/bin/python benchmarks/train_eagle3.py --out results/eagle3-smollm2 \
        [--model MODEL] [--num-prompts 256] [--output-len 192] [--steps 2000] [--lr 3e-4] \
        [--draft-vocab 8192] [--ttt-steps 3] [--aux-layers 2,15,27] [--seed 0] \
        [--greedy-share 0.3] [--val-share 0.05]

then serve with `--speculative-config '{"method": "eagle3", "model": OUT}'`.

1. *Data*: the target (the engine; greedy for `--greedy-share` of them, else temperature
   0.8) answers `--num-prompts` varied prompts (eagle3_prompts.py: chat requests of many
   kinds and subjects, and plain-text openings without the chat template), so the head
   learns the target's distribution on the target's own text, in the states it visits both
   with and without the chat template, sampled and greedy.
2. *Target states*: one forward of the target (the engine's model class) per sequence gives
   the residual stream entering the auxiliary layers and the final hidden state (the
   target's logits over the draft vocabulary are computed from it when a sequence is
   trained on); the draft vocabulary is the `--draft-vocab` most frequent tokens of the data.
3. *Training*: the engine's own head module (model_executor/models/eagle3_head.py), its
   attention swapped for a dense one that does EAGLE-3's test-time training: step 0 reads
   the target's states at every position; step s feeds back the head's own hidden state
   of step s - 1 with the next token of the text, attending to step 0's keys up to its
   position and to its own earlier steps' keys at that position (what drafting s tokens
   ahead sees). The loss is the cross-entropy against the target's distribution over the
   draft vocabulary, step s weighted 0.8^s. The LM head starts as the target's rows, the
   final norm as the target's; the token embedding is the target's (not trained, not saved).
4. *Held-out check*: `--val-share` of the sequences are never trained on; at the end the
   script prints the head's top-1 agreement with the target's greedy token at each
   test-time step on them (teacher-forced: what acceptance per draft position would be if
   the earlier drafts were right). The training figure overstates it: each sequence is
   seen several times.
5. *Output*: the original EAGLE-3 layout (config.json, model.safetensors with fc, midlayer,
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


def generate_data(model: str | None, num_prompts: int, output_len: int, seed: int,
                  greedy_share: float = 0.3) -> list[list[int]]:
    """The target's own text: prompt and reply token ids, one list per prompt of
    eagle3_prompts.make_prompts (chat ones through the chat template, plain ones as they
    are), each reply greedy with probability `greedy_share`, else sampled."""
    from eagle3_prompts import make_prompts

    from vllm import LLM, SamplingParams

    rng = random.Random(seed)
    items = make_prompts(num_prompts, seed)
    params = [SamplingParams(temperature=0.0, max_tokens=output_len)
              if rng.random() < greedy_share else
              SamplingParams(temperature=0.8, top_p=0.95, max_tokens=output_len, seed=seed + i)
              for i in range(num_prompts)]
    chat = [i for i, p in enumerate(items) if p.chat is not None]
    plain = [i for i, p in enumerate(items) if p.chat is None]
    llm = LLM(model, max_num_seqs=max(1, min(num_prompts, 64)))
    outs: dict[int, Any] = {}
    try:
        if chat:
            done = llm.chat([items[i].chat for i in chat], [params[i] for i in chat],
                            use_tqdm=False)
            outs.update(zip(chat, done))
        if plain:
            done = llm.generate([items[i].text for i in plain], [params[i] for i in plain],
                                use_tqdm=False)
            outs.update(zip(plain, done))
    finally:
        llm.shutdown()
    return [list(outs[i].prompt_token_ids) + list(outs[i].outputs[0].token_ids)
            for i in range(num_prompts)]


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
    """One sequence through the target: (auxiliary states [T, n_aux * hidden], final hidden
    states [T, hidden], the LM head's input) in float32 on the target's device."""
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
    return aux, hidden.float().clone()


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


def ttt_steps_logits(head, aux: torch.Tensor, tokens: torch.Tensor, steps: int):
    """Yields (s, the head's draft-vocabulary logits [valid, draft vocab] of test-time step
    s) over one sequence: row i predicts the token at i + 2 + s (rows whose token lies past
    the text's end are left out)."""
    for layer in head.layers:
        layer.self_attn.attn.reset()
    n = len(tokens) - 1  # position i reads token i + 1
    positions = torch.arange(n, device=aux.device)
    hidden = head.combine(aux[:n])
    # Step s feeds token i + 1 + s at index i: past the text's end, padding (as speculators
    # does), whose outputs nothing reads.
    padded = torch.cat([tokens, tokens.new_zeros(steps)])
    for s in range(steps):
        valid = n - 1 - s  # index i predicts the token after position i + 1 + s
        if valid <= 0:
            break
        out = head(padded[1 + s : 1 + s + n], hidden, positions + s,
                   [None] * head.num_layers, None)
        yield s, head.compute_logits(out[:valid])
        hidden = head.carry(out)


def ttt_loss(head, aux: torch.Tensor, tokens: torch.Tensor, target_logprobs: torch.Tensor,
             steps: int, decay: float = 0.8) -> tuple[torch.Tensor, float]:
    """The test-time-training loss over one sequence, and step 0's top-1 agreement with
    the target: `target_logprobs` [T, draft vocab] are the target's log-probabilities over
    the draft vocabulary at each position (of the token after it)."""
    total = aux.new_zeros(())
    agree = 0.0
    for s, logits in ttt_steps_logits(head, aux, tokens, steps):
        logprobs = torch.log_softmax(logits, dim=-1)
        want = target_logprobs[1 + s : 1 + s + len(logits)]
        total = total + decay**s * -(want.exp() * logprobs).sum(-1).mean()
        if s == 0:
            agree = float((logprobs.argmax(-1) == want.argmax(-1)).float().mean())
    return total, agree


@torch.no_grad()
def held_out_agreement(head, data: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                       steps: int, lm_head: torch.Tensor) -> list[float]:
    """Per test-time step, the share of positions (over `data`: (aux, tokens, final hidden
    states)) where the head's top-1, mapped to a target id, is the target's greedy token
    (argmax of `lm_head` [vocab, hidden] over the final hidden state, the whole vocabulary:
    a token outside the draft vocabulary is a miss, as when drafting)."""
    hits, counts = [0] * steps, [0] * steps
    for aux, tokens, final in data:
        for s, logits in ttt_steps_logits(head, aux, tokens, steps):
            want = (final[1 + s : 1 + s + len(logits)] @ lm_head.T).argmax(-1)
            hits[s] += int((head.d2t_ids[logits.argmax(-1)] == want).sum())
            counts[s] += len(logits)
    return [h / c if c else 0.0 for h, c in zip(hits, counts)]


def train(head, data: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], steps: int,
          lr: float, ttt_steps: int, draft_lm_head: torch.Tensor,
          log_every: int = 50) -> list[float]:
    """AdamW with a cosine decay over `steps` steps, one sequence per step (cycling through
    `data`: (aux, tokens, final hidden states); the target's log-probabilities over the
    draft vocabulary come from the final states and `draft_lm_head`, the target's LM head
    rows of the draft vocabulary); returns each step's loss."""
    trainable = [p for n, p in head.named_parameters() if not n.startswith("embed")]
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / max(steps, 1)))
        aux, tokens, final = data[step % len(data)]
        with torch.no_grad():
            target_logprobs = torch.log_softmax(final @ draft_lm_head.T, dim=-1)
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
    sequences = generate_data(args.model, args.num_prompts, args.output_len, args.seed,
                              args.greedy_share)
    print(f"{len(sequences)} sequences, {sum(map(len, sequences))} tokens "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    from vllm.engine.arg_utils import EngineArgs

    longest = max(map(len, sequences))
    model_config = EngineArgs(model=args.model).create_engine_config().model_config
    hf = model_config.hf_config
    aux_layers = ([int(x) for x in args.aux_layers.split(",")] if args.aux_layers
                  else default_aux_layers(hf.num_hidden_layers))
    target = load_target(model_config, aux_layers, longest)
    # The held-out sequences: the last ones (the prompts come in random order).
    num_val = min(len(sequences) - 1, round(len(sequences) * args.val_share))
    num_train = len(sequences) - num_val
    vocab = draft_vocabulary(sequences[:num_train], args.draft_vocab, hf.vocab_size)
    lm_head = target.lm_head.weight.detach().float()
    draft_lm_head = lm_head[torch.tensor(vocab, device=lm_head.device)]
    data = []
    for seq in sequences:
        aux, final = target_states(target, seq)
        data.append((aux, torch.tensor(seq, device=aux.device), final))
    print(f"target states of aux layers {aux_layers} ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    train_data, val_data = data[:num_train], data[num_train:]
    head = new_head(target, hf, vocab, aux_layers, args.out, args.seed,
                    longest + args.ttt_steps)
    losses = train(head, train_data, args.steps, args.lr, args.ttt_steps, draft_lm_head)
    if val_data:
        agree = held_out_agreement(head, val_data, args.ttt_steps, lm_head)
        print(f"held-out top-1 agreement with the target's greedy token per step "
              f"({num_val} sequences): {' '.join(f'{a:.3f}' for a in agree)}", flush=True)
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
    parser.add_argument("--greedy-share", type=float, default=0.3,
                        help="share of the target's replies generated greedily (else sampled)")
    parser.add_argument("--val-share", type=float, default=0.05,
                        help="share of the sequences held out of training, to report on")
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse())
