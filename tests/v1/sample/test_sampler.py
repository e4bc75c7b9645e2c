"""Tests for vllm/v1/sample/sampler.py against naive full-sort / float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from v1.sample.goodness_of_fit import chi_square_test

from vllm.v1.sample import sampler as sampler_mod
from vllm.v1.sample.ops import race_sampling
from vllm.v1.sample.metadata import GrammarMask, SamplingMetadata
from vllm.v1.sample.sampler import Sampler

INF = float("inf")


def make_md(n: int, **fields) -> SamplingMetadata:
    """Metadata for n random rows (temperature 1, unseeded) with `fields` overridden."""
    return SamplingMetadata.plain(torch.ones(n), torch.Generator().manual_seed(1234), **fields)


def allowed(row: torch.Tensor, temp: float, k: int, p: float, min_p: float) -> set[int]:
    """Naive reference: the token ids a random row may sample (full sort, float64)."""
    z = (row.double() - row.double().max()) / temp
    keep = torch.isfinite(z)
    desc = torch.sort(z, descending=True).values
    if 0 < k < z.numel():
        keep &= z >= desc[k - 1]
    if p < 1.0:
        zk = z.masked_fill(~keep, -INF)
        probs = torch.softmax(zk, dim=0)
        sp, order = torch.sort(probs, descending=True)
        cross = int((sp.cumsum(0) < p).sum().clamp(max=z.numel() - 1))
        keep &= z >= zk[order[cross]]
    if min_p > 0:
        probs = torch.softmax(z, dim=0)
        keep &= probs >= min_p * probs.max()
    return set(torch.nonzero(keep).squeeze(1).tolist())


def row_params(md: SamplingMetadata, i: int) -> tuple[float, int, float, float]:
    return (
        float(md.temperature[i]),
        int(md.top_k[i]) if md.top_k is not None else 0,
        float(md.top_p[i]) if md.top_p is not None else 1.0,
        float(md.min_p[i]) if md.min_p is not None else 0.0,
    )


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    mask = expected > 0
    return float((((counts - expected) ** 2)[mask] / expected[mask]).sum())


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 300, generator=g)
    logits[3, [10, 20, 30]] = 50.0  # tie: lowest id wins
    logits[4] = 0.0  # all tied
    md = make_md(9, temperature=None, all_greedy=True, all_random=False)
    out = Sampler(chunk_rows=4)(logits, md).sampled_token_ids
    assert out.dtype == torch.int64
    assert out.tolist() == torch.argmax(logits, dim=1).tolist()
    assert int(out[3]) == 10 and int(out[4]) == 0


def _grammar(n: int, vocab: int, seed: int) -> GrammarMask:
    """Random masks (whole words allowed, forbidden or mixed) on every other row; one
    constrained row allows nothing."""
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    bits = torch.randint(-(2**31), 2**31 - 1, (n, words), generator=g, dtype=torch.int64)
    bits[:, ::3] = 0
    bits[:, 1::5] = -1
    bits[1] = 0
    rows = torch.arange(n)
    rows[::2] = -1
    return GrammarMask(bits.to(torch.int32).numpy(), rows.numpy())


def _masked(logits: torch.Tensor, grammar: GrammarMask) -> torch.Tensor:
    """Reference: the logits with -inf written over every forbidden token, bit by bit."""
    out = logits.clone()
    for r, m in enumerate(grammar.rows.tolist()):
        if m < 0:
            continue
        for t in range(logits.shape[1]):
            if not (int(grammar.bitmask[m, t // 32]) >> (t % 32)) & 1:
                out[r, t] = -INF
    return out


def test_fused_greedy_argmax_reads_the_grammar_mask_without_writing() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(10, 300, generator=g).round()  # rounded: many ties
    logits[4, 7] = float("nan")
    grammar = _grammar(10, 300, 5)
    before = logits.clone()
    md = make_md(10, temperature=None, all_greedy=True, all_random=False, grammar_mask=grammar)
    out = Sampler()(logits, md).sampled_token_ids
    assert out.tolist() == torch.argmax(_masked(logits, grammar), dim=1).tolist()
    assert torch.equal(logits.isnan(), before.isnan())
    assert torch.equal(logits.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("logprobs", [None, 3])
def test_grammar_mask_equals_masking_the_logits_first(logprobs: int | None) -> None:
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(10, 300, generator=g)
    grammar = _grammar(10, 300, 6)
    temp = torch.tensor([0.0, 1.0] * 5)
    common = dict(temperature=temp, all_random=False, max_num_logprobs=logprobs)
    got = Sampler(chunk_rows=3)(logits.clone(), make_md(10, grammar_mask=grammar, **common))
    want = Sampler(chunk_rows=3)(_masked(logits, grammar), make_md(10, **common))
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    assert (got.logprobs is None) == (want.logprobs is None)
    if want.logprobs is not None:
        assert torch.equal(got.logprobs.token_ids, want.logprobs.token_ids)
        # Bitwise, NaN included (the row that allows nothing has no distribution).
        torch.testing.assert_close(got.logprobs.logprobs, want.logprobs.logprobs, rtol=0,
                                   atol=0, equal_nan=True)
        assert torch.equal(got.logprobs.ranks, want.logprobs.ranks)


def test_grammar_mask_needs_contiguous_cpu_float32_logits() -> None:
    grammar = _grammar(2, 64, 0)
    md = make_md(2, temperature=None, all_greedy=True, all_random=False, grammar_mask=grammar)
    with pytest.raises(ValueError, match="grammar_mask"):
        Sampler()(torch.zeros(2, 64, dtype=torch.float64), md)
    with pytest.raises(ValueError, match="grammar_mask"):
        three_rows = _grammar(3, 64, 0)
        Sampler()(torch.zeros(2, 64), make_md(
            2, temperature=None, all_greedy=True, all_random=False, grammar_mask=three_rows))


def test_mixed_batch_greedy_rows_take_argmax_and_input_is_untouched() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 257, generator=g)
    before = logits.clone()
    temp = torch.tensor([0.0, 1.0, 1e-6, 0.7] * 3)
    md = make_md(
        12, temperature=temp, all_random=False, top_k=torch.full((12,), 3, dtype=torch.int32)
    )
    out = Sampler(chunk_rows=5)(logits, md).sampled_token_ids
    greedy = temp < 1e-5
    assert out[greedy].tolist() == logits.argmax(1)[greedy].tolist()
    assert torch.equal(logits, before)


# ------------------------------------------------------------------------ support


SUPPORT_CASES = {
    "temperature": dict(temp=0.7),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.6),
    "min_p": dict(min_p=0.2),
    "top_k_top_p": dict(top_k=20, top_p=0.5),
    "all": dict(temp=1.3, top_k=30, top_p=0.8, min_p=0.05),
}


@pytest.mark.parametrize("case", sorted(SUPPORT_CASES))
@pytest.mark.parametrize("candidates", [1024, 8])
def test_sampled_tokens_stay_inside_the_reference_support(case: str, candidates: int) -> None:
    cfg = SUPPORT_CASES[case]
    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 600, generator=g) * torch.tensor(
        [[0.3], [1.0], [2.0], [3.0], [5.0], [8.0]]
    )
    base[1, ::3] = -INF  # grammar-style masking
    reps = 40
    logits = base.repeat_interleave(reps, dim=0)
    n = logits.shape[0]
    fields: dict = {"temperature": torch.full((n,), cfg.get("temp", 1.0))}
    if "top_k" in cfg:
        fields["top_k"] = torch.full((n,), cfg["top_k"], dtype=torch.int32)
    if "top_p" in cfg:
        fields["top_p"] = torch.full((n,), cfg["top_p"])
    if "min_p" in cfg:
        fields["min_p"] = torch.full((n,), cfg["min_p"])
    # Half the rows seeded, half from the generator.
    fields["seeds"] = [i if i % 2 else None for i in range(n)]
    md = make_md(n, **fields)
    out = Sampler(top_p_candidates=candidates, race_block=64)(logits, md).sampled_token_ids
    for r in range(base.shape[0]):
        ok = allowed(base[r], *row_params(md, r * reps))
        got = set(out[r * reps : (r + 1) * reps].tolist())
        assert got <= ok, f"row {r}: sampled {sorted(got - ok)} outside the support"


def test_real_vocab_rows_stay_in_support() -> None:
    vocab = 151936
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, vocab, generator=g) * 3
    md = make_md(
        4,
        temperature=torch.tensor([0.8, 1.0, 0.5, 1.2]),
        top_k=torch.tensor([0, 40, 0, 0], dtype=torch.int32),
        top_p=torch.tensor([1.0, 1.0, 0.95, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.1]),
        seeds=[1, None, 2, None],
    )
    out = Sampler()(logits, md).sampled_token_ids
    for r in range(4):
        assert int(out[r]) in allowed(logits[r], *row_params(md, r))


def test_top_p_fallback_full_sort_is_used_and_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = sampler_mod.sorted_candidates

    def spy(z, *args):
        calls.append(z.shape[0])
        return real(z, *args)

    monkeypatch.setattr(sampler_mod, "sorted_candidates", spy)
    g = torch.Generator().manual_seed(5)
    flat = torch.randn(1, 4096, generator=g) * 0.5  # top-1024 mass ~ 0.4 < p
    peaked = torch.randn(1, 4096, generator=g) * 6  # nucleus well inside 1024
    logits = torch.cat([flat.repeat(30, 1), peaked.repeat(30, 1)])
    md = make_md(60, top_p=torch.full((60,), 0.9), seeds=list(range(60)))
    out = Sampler()(logits, md).sampled_token_ids
    assert calls == [30]  # only the flat rows were sorted fully
    ok_flat = allowed(flat[0], 1.0, 0, 0.9, 0.0)
    ok_peaked = allowed(peaked[0], 1.0, 0, 0.9, 0.0)
    assert len(ok_flat) > 1024
    assert set(out[:30].tolist()) <= ok_flat
    assert set(out[30:].tolist()) <= ok_peaked


# ------------------------------------------------------------------- distribution


def sample_counts(logits_row: torch.Tensor, n: int, sampler: Sampler, **fields) -> torch.Tensor:
    logits = logits_row.repeat(n, 1)
    out = sampler(logits, make_md(n, **fields)).sampled_token_ids
    return torch.bincount(out, minlength=logits_row.numel()).double()


@pytest.mark.parametrize("block", [3, 512])
@pytest.mark.parametrize("seeded", [False, True])
def test_race_samples_proportionally_to_probs(block: int, seeded: bool) -> None:
    logits = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 1.5, -INF, 0.2])
    n = 6000
    seeds = list(range(n)) if seeded else [None] * n
    temp = 0.9
    counts = sample_counts(
        logits, n, Sampler(race_block=block), temperature=torch.full((n,), temp), seeds=seeds
    )
    probs = torch.softmax(logits.double() / temp, dim=0)
    assert counts[6] == 0
    # 6 degrees of freedom: P(chi2 > 30) ~ 4e-5.
    assert chi_square(counts, probs) < 30


def test_filtered_distribution_is_renormalized() -> None:
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    n = 6000
    counts = sample_counts(
        logits,
        n,
        Sampler(),
        top_k=torch.full((n,), 4, dtype=torch.int32),
        top_p=torch.full((n,), 0.9),
    )
    # Reference: top-4 renormalized, then the smallest prefix reaching 0.9.
    p4 = torch.softmax(logits[:4].double(), dim=0)
    cut = int((p4.cumsum(0) < 0.9).sum()) + 1
    probs = torch.zeros(6, dtype=torch.float64)
    probs[:cut] = p4[:cut] / p4[:cut].sum()
    assert counts[cut:].sum() == 0
    assert chi_square(counts[:cut], probs[:cut]) < 25


# -------------------------------------------------------------------------- seeds


def seeded_batch(rows: list[tuple[torch.Tensor, dict]], **kw) -> torch.Tensor:
    """Samples a batch built from (logits row, per-row params) pairs."""
    n = len(rows)
    logits = torch.stack([r for r, _ in rows])
    get = lambda key, default: [p.get(key, default) for _, p in rows]  # noqa: E731
    md = make_md(
        n,
        temperature=torch.tensor(get("temp", 1.0)),
        all_random=all(t >= 1e-5 for t in get("temp", 1.0)),
        top_k=torch.tensor(get("top_k", 0), dtype=torch.int32),
        top_p=torch.tensor(get("top_p", 1.0)),
        min_p=torch.tensor(get("min_p", 0.0)),
        seeds=get("seed", None),
        output_positions=get("pos", 0),
        generator=torch.Generator().manual_seed(kw.pop("gen_seed", 0)),
    )
    return Sampler(top_p_candidates=16, race_block=32, **kw)(logits, md).sampled_token_ids


def test_seeded_rows_are_independent_of_run_batch_and_order() -> None:
    g = torch.Generator().manual_seed(11)
    vocab = 500
    seeded = [
        (torch.randn(vocab, generator=g), dict(seed=1, pos=0)),
        (torch.randn(vocab, generator=g) * 0.2, dict(seed=2, pos=5, temp=0.7)),
        (torch.randn(vocab, generator=g), dict(seed=3, pos=1, top_k=7)),
        (torch.randn(vocab, generator=g) * 0.3, dict(seed=4, pos=2, top_p=0.8)),  # fallback
        (torch.randn(vocab, generator=g) * 4, dict(seed=5, pos=9, top_p=0.5, min_p=0.1)),
        (torch.randn(vocab, generator=g), dict(seed=-6, pos=3, min_p=0.3, temp=1.5)),
    ]
    others = [
        (torch.randn(vocab, generator=g), dict()),
        (torch.randn(vocab, generator=g), dict(temp=0.0)),
        (torch.randn(vocab, generator=g), dict(top_k=200)),  # changes the candidate count
        (torch.randn(vocab, generator=g), dict(top_p=0.95, seed=99)),
    ]
    alone = seeded_batch(seeded).tolist()
    assert seeded_batch(seeded, gen_seed=5).tolist() == alone
    for i, row in enumerate(seeded):
        assert seeded_batch([row]).tolist() == [alone[i]]
    mixed = [others[0], seeded[3], others[1], seeded[0], seeded[5], others[2], seeded[1]]
    mixed += [seeded[4], others[3], seeded[2]]
    got = seeded_batch(mixed, chunk_rows=3).tolist()
    where = {id(r): k for k, r in enumerate(mixed)}
    assert [got[where[id(r)]] for r in seeded] == alone


def test_different_seeds_or_positions_give_different_tokens() -> None:
    vocab = 1000
    flat = torch.zeros(vocab)
    n = 300
    by_seed = sampler_tokens(flat, seeds=list(range(n)), positions=[4] * n)
    by_pos = sampler_tokens(flat, seeds=[42] * n, positions=list(range(n)))
    # 300 uniform draws from 1000 give about 259 distinct values.
    assert len(set(by_seed)) > 230
    assert len(set(by_pos)) > 230
    assert sum(a == b for a, b in zip(by_seed, by_pos, strict=True)) < 10


def sampler_tokens(row: torch.Tensor, seeds: list, positions: list[int]) -> list[int]:
    n = len(seeds)
    md = make_md(n, seeds=seeds, output_positions=positions)
    return Sampler()(row.repeat(n, 1), md).sampled_token_ids.tolist()


def test_unseeded_rows_follow_the_generator() -> None:
    flat = torch.zeros(64, 1000)
    a = Sampler()(flat, make_md(64, generator=torch.Generator().manual_seed(1))).sampled_token_ids
    b = Sampler()(flat, make_md(64, generator=torch.Generator().manual_seed(1))).sampled_token_ids
    c = Sampler()(flat, make_md(64, generator=torch.Generator().manual_seed(2))).sampled_token_ids
    assert torch.equal(a, b)
    assert int((a != c).sum()) > 50


# ---------------------------------------------------------------------- penalties


def naive_penalties(
    row: list[float], prompt: list[int], output: list[int], rep: float, freq: float, pres: float
) -> list[float]:
    out = list(row)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        c = output.count(t)
        out[t] -= freq * c + pres
    return out


def test_penalties_change_greedy_choice_like_the_reference() -> None:
    g = torch.Generator().manual_seed(21)
    vocab = 40
    n = 24
    logits = torch.randn(n, vocab, generator=g) * 2
    prompts = [
        torch.randint(
            0, vocab, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]
    outputs = [
        torch.randint(
            0, vocab, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]
    rep = torch.rand(n, generator=g) * 1.5 + 0.5
    freq = torch.rand(n, generator=g) * 4 - 2
    pres = torch.rand(n, generator=g) * 4 - 2
    width = max(len(p) for p in prompts)
    prompt_t = torch.full((n, width), vocab, dtype=torch.int64)
    for i, p in enumerate(prompts):
        prompt_t[i, : len(p)] = torch.tensor(p)
    md = make_md(
        n,
        temperature=None,
        all_greedy=True,
        all_random=False,
        no_penalties=False,
        repetition_penalties=rep,
        frequency_penalties=freq,
        presence_penalties=pres,
        prompt_token_ids=prompt_t,
        output_token_ids=outputs,
    )
    out = Sampler(chunk_rows=7)(logits, md).sampled_token_ids.tolist()
    changed = 0
    for i in range(n):
        ref = naive_penalties(
            logits[i].tolist(),
            prompts[i],
            outputs[i],
            float(rep[i]),
            float(freq[i]),
            float(pres[i]),
        )
        assert out[i] == max(range(vocab), key=lambda t: (ref[t], -t))
        changed += out[i] != int(logits[i].argmax())
    assert changed >= 5  # the penalties actually mattered


# --------------------------------------------------------------------- min_tokens


def test_min_tokens_bans_stop_ids_until_reached() -> None:
    vocab = 50
    logits = torch.zeros(4, vocab)
    logits[:, 7] = 30.0  # the stop id is by far the likeliest
    logits[:, 9] = 29.0
    md = make_md(
        4,
        temperature=torch.tensor([0.0, 1.0, 0.0, 1.0]),
        all_random=False,
        output_positions=[0, 2, 3, 3],
        min_tokens={0: (1, {7}), 1: (3, {7, 9}), 2: (3, {7}), 3: (4, {7, 9})},
    )
    out = Sampler()(logits, md).sampled_token_ids.tolist()
    assert out[0] == 9  # greedy, 7 banned
    assert out[1] not in (7, 9)  # both banned
    assert out[2] == 7  # min_tokens reached: no ban
    assert out[3] not in (7, 9)
    n = 200
    many = make_md(
        n,
        output_positions=[0] * n,
        min_tokens={i: (1, {7}) for i in range(n)},
        seeds=list(range(n)),
    )
    assert 7 not in Sampler()(logits[:1].repeat(n, 1), many).sampled_token_ids.tolist()


# ----------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_match_log_softmax_of_raw_logits(k: int) -> None:
    g = torch.Generator().manual_seed(31)
    vocab = 200
    logits = torch.randn(10, vocab, generator=g) * 3
    logits[2, 50:] = -INF
    md = make_md(
        10,
        temperature=torch.full((10,), 0.6),
        top_k=torch.full((10,), 20, dtype=torch.int32),
        no_penalties=False,
        repetition_penalties=torch.full((10,), 1.3),
        presence_penalties=None,
        frequency_penalties=None,
        prompt_token_ids=torch.randint(0, vocab, (10, 5), generator=g),
        output_token_ids=[[1, 2]] * 10,
        max_num_logprobs=k,
    )
    out = Sampler(chunk_rows=3)(logits, md)
    lp = out.logprobs
    assert lp is not None
    assert lp.token_ids.shape == (10, k + 1) and lp.logprobs.shape == (10, k + 1)
    ref = torch.log_softmax(logits.double(), dim=1)
    tok = out.sampled_token_ids
    assert torch.equal(lp.token_ids[:, 0], tok)
    torch.testing.assert_close(lp.logprobs[:, 0].double(), ref.gather(1, tok[:, None]).squeeze(1))
    ranks = (ref > ref.gather(1, tok[:, None])).sum(1) + 1
    assert lp.ranks.tolist() == ranks.tolist()
    if k:
        vals, ids = torch.topk(ref, k, dim=1)
        assert lp.token_ids[:, 1:].tolist() == ids.tolist()
        torch.testing.assert_close(lp.logprobs[:, 1:].double(), vals)


def test_no_logprobs_unless_asked() -> None:
    out = Sampler()(torch.zeros(2, 10), make_md(2))
    assert out.logprobs is None


# --------------------------------------------------------------------- validation


def test_bad_inputs_raise_value_error_naming_the_field() -> None:
    s = Sampler()
    with pytest.raises(ValueError, match="logits"):
        s(torch.zeros(10), make_md(1))
    with pytest.raises(ValueError, match="top_k"):
        s(torch.zeros(2, 10), make_md(2, top_k=torch.zeros(3, dtype=torch.int32)))
    with pytest.raises(ValueError, match="seeds"):
        s(torch.zeros(2, 10), make_md(2, seeds=[None]))
    with pytest.raises(ValueError, match="temperature"):
        s(torch.zeros(2, 10), make_md(2, temperature=None))
    with pytest.raises(ValueError, match="min_tokens"):
        s(torch.zeros(2, 10), make_md(2, min_tokens={2: (2, {1})}))
    # A stop id outside the vocabulary cannot be sampled anyway: ignored, not an error.
    s(torch.zeros(2, 10), make_md(2, min_tokens={0: (2, {10, 3})}))
    with pytest.raises(ValueError, match="top_p_candidates"):
        Sampler(top_p_candidates=0)


def test_empty_batch() -> None:
    out = Sampler()(torch.zeros(0, 10), make_md(0, max_num_logprobs=2))
    assert out.sampled_token_ids.shape == (0,)
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (0, 3)


def test_chi_square_helper_detects_a_wrong_distribution() -> None:
    # Guards the distribution tests: a uniform sample must fail against a skewed reference.
    counts = torch.full((8,), 750.0, dtype=torch.float64)
    probs = torch.softmax(torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 1.5, 0.3, 0.2]).double(), 0)
    assert chi_square(counts, probs) > 100
    assert math.isfinite(chi_square(counts, torch.full((8,), 1 / 8, dtype=torch.float64)))


# ------------------------------------------------- distribution: goodness of fit


def reference_probs(row: torch.Tensor, temp: float, k: int, p: float, min_p: float) -> torch.Tensor:
    """float64 distribution a random row must follow: softmax(z / T) over the kept set."""
    keep = torch.zeros(row.numel(), dtype=torch.bool)
    keep[sorted(allowed(row, temp, k, p, min_p))] = True
    z = (row.double() - row.double().max()) / temp
    return torch.softmax(z.masked_fill(~keep, -INF), dim=0)


GOF_CASES = {
    # name: (temperature, top_k, top_p, min_p, sampler options)
    "temperature_blocks": (0.7, 0, 1.0, 0.0, dict(race_block=7)),
    "min_p_blocks": (1.0, 0, 1.0, 0.03, dict(race_block=7)),
    "top_k": (1.3, 15, 1.0, 0.0, dict()),
    "top_p_full_sort": (1.0, 0, 0.8, 0.0, dict(top_p_candidates=8)),
    "all": (0.9, 25, 0.9, 0.02, dict()),
}


@pytest.mark.parametrize("case", sorted(GOF_CASES))
def test_sampler_distribution_chi_square(case: str) -> None:
    temp, k, p, min_p, opts = GOF_CASES[case]
    g = torch.Generator().manual_seed(41)
    vocab, n = 60, 20_000
    row = torch.randn(vocab, generator=g) * 1.5
    row[[5, 17, 18, 19, 40]] = -INF  # grammar-style masking
    fields: dict = {"temperature": torch.full((n,), temp)}
    if k:
        fields["top_k"] = torch.full((n,), k, dtype=torch.int32)
    if p < 1.0:
        fields["top_p"] = torch.full((n,), p)
    if min_p:
        fields["min_p"] = torch.full((n,), min_p)
    # Half the rows seeded (distinct seeds), half drawing keys from the generator.
    fields["seeds"] = [i if i % 2 else None for i in range(n)]
    counts = sample_counts(row, n, Sampler(**opts), **fields)
    probs = reference_probs(row, temp, k, p, min_p)
    result = chi_square_test(counts, probs)
    assert result.passed, f"{case}: {result}"
    # The test can fail: the same draws against a slightly different temperature.
    assert not chi_square_test(counts, reference_probs(row, temp * 1.1, k, p, min_p)).passed


def test_masked_tokens_and_blocks_with_the_largest_noise_are_never_sampled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Pins the noise of every masked token and every all-masked block to the largest value
    # the hash can give (all ones): a masked choice must still never win.
    vocab, block = 4096, 512
    g = torch.Generator().manual_seed(43)
    logits = torch.full((1, vocab), -INF)
    ok = torch.tensor([3, 100, 600, 700, 2600, 2601, 4095])
    logits[0, ok] = torch.randn(ok.numel(), generator=g)
    masked = torch.ones(vocab + vocab // block, dtype=torch.bool)
    masked[ok] = False
    masked[vocab + ok // block] = False
    real = race_sampling.noise_hash

    def pinned(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
        h = real(keys, counters)
        return torch.where(masked[counters], torch.full_like(h, 0xFFFFFFFF), h)

    monkeypatch.setattr(race_sampling, "noise_hash", pinned)
    n = 8
    md = make_md(
        5 * n,
        temperature=torch.tensor([1.0, 0.5, 1.0, 1.0, 2.0] * n),
        top_k=torch.tensor([0, 0, 20, 0, 50] * n, dtype=torch.int32),
        top_p=torch.tensor([1.0, 1.0, 1.0, 0.9, 0.95] * n),
        min_p=torch.tensor([0.0, 0.1, 0.0, 0.0, 0.01] * n),
        seeds=list(range(5 * n)),
    )
    out = Sampler(race_block=block, top_p_candidates=4)(logits.repeat(5 * n, 1), md)
    assert set(out.sampled_token_ids.tolist()) <= set(ok.tolist())
