"""The engine core's stats record, in parts by owner (docs/architecture.md section 4).

`EngineCoreStats` is what the engine core sends as its STATS payload and what /metrics
renders. Each part belongs to the component that counts it and merges itself across engines
(`-dp`): the KV cache manager's `KVCacheStats`, the drafter's `SpecDecodeStats` (speculative
decoding and grammar fast-forward) and the grammar manager's `GrammarStats`. A new metric is
one field in its part, plus one line in prometheus.py (and the code that counts it): a
counter's merge is the sum, which `_sum` gives every numeric field by default.

Imports nothing but msgspec, so the API server decodes the record without the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import msgspec

_S = TypeVar("_S", bound=msgspec.Struct)


def _sum(cls: type[_S], parts: Sequence[_S], **given: object) -> _S:
    """A `cls` whose fields are the sums of `parts`' fields, except those `given`."""
    fields = {
        name: sum(getattr(p, name) for p in parts)
        for name in cls.__struct_fields__ if name not in given
    }
    return cls(**fields, **given)


class KVCacheStats(msgspec.Struct, array_like=True):
    """The KV cache's gauges and the prefix cache's counters (`KVCacheManager.make_stats`)."""

    # Fraction of KV blocks owned by requests, in [0, 1].
    usage: float = 0.0
    # Blocks no request owns (free, or cached prefix blocks that can be evicted).
    num_free_blocks: int = 0
    # All KV blocks the engine allocated; fixed after startup.
    num_blocks: int = 0
    # Prompt tokens looked up in the prefix cache (cumulative).
    prefix_cache_queries: int = 0
    # Prompt tokens found in the prefix cache (cumulative).
    prefix_cache_hits: int = 0

    @staticmethod
    def merge(parts: Sequence[KVCacheStats]) -> KVCacheStats:
        """Several engines' caches as one: blocks and counters add up, usage is weighted by
        each engine's blocks."""
        blocks = sum(p.num_blocks for p in parts)
        usage = sum(p.usage * p.num_blocks for p in parts) / blocks if blocks else 0.0
        return _sum(KVCacheStats, parts, usage=usage)

    def of_dead_engine(self) -> KVCacheStats:
        """The cache once its engine is gone: no blocks, no usage; the counters stay."""
        return KVCacheStats(prefix_cache_queries=self.prefix_cache_queries,
                            prefix_cache_hits=self.prefix_cache_hits)


class SpecDecodeStats(msgspec.Struct, array_like=True):
    """Cumulative counters of draft verifications (the scheduler's `Drafter` counts them).

    Acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / steps
    (each verification also samples one token).
    """

    # Verification steps in which a request carried drafts.
    num_steps: int = 0
    # Drafted tokens sent for verification.
    num_draft_tokens: int = 0
    # Drafted tokens the target model kept (and the stop checks let through).
    num_accepted_tokens: int = 0
    # Grammar fast-forward: drafted tokens the grammar forced (among num_draft_tokens),
    # those kept (each a forward pass its request did not need), and finished requests that
    # kept at least one (forced tokens per fast-forwarded request = kept / requests).
    num_forced_tokens: int = 0
    num_forced_kept_tokens: int = 0
    num_fast_forwarded_requests: int = 0
    # Kept drafts by position in the draft (index 0: the first drafted token); as long as
    # the longest draft verified so far. Drafts are kept as a prefix, so a verification
    # that kept k drafts counts once at each of positions 0 .. k-1.
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int, num_forced: int = 0) -> int:
        """Counts one verification of `num_drafts` drafts, the first `num_forced` of them
        forced, of which `num_accepted` were kept. Returns how many forced ones were kept."""
        self.num_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for position in range(min(num_accepted, num_drafts)):
            per_pos[position] += 1
        kept_forced = min(num_forced, num_accepted)
        self.num_forced_tokens += num_forced
        self.num_forced_kept_tokens += kept_forced
        return kept_forced

    def snapshot(self) -> SpecDecodeStats:
        """A copy that later counting does not change."""
        return msgspec.structs.replace(
            self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    @staticmethod
    def merge(parts: Sequence[SpecDecodeStats]) -> SpecDecodeStats:
        """Several engines' counters as one: every counter adds up (per position too)."""
        longest = max((len(p.num_accepted_tokens_per_pos) for p in parts), default=0)
        per_pos = [0] * longest
        for part in parts:
            for position, count in enumerate(part.num_accepted_tokens_per_pos):
                per_pos[position] += count
        return _sum(SpecDecodeStats, parts, num_accepted_tokens_per_pos=per_pos)


class GrammarStats(msgspec.Struct, array_like=True):
    """Structured-output compiles by backend (the grammar manager counts them)."""

    # (backend, reason, count), sorted, cumulative: reason is "first_choice", or "fallback"
    # when an earlier backend could not enforce the constraint.
    backends: list[tuple[str, str, int]] = msgspec.field(default_factory=list)

    @staticmethod
    def merge(parts: Sequence[GrammarStats]) -> GrammarStats:
        """Several engines' compiles as one: counts of the same (backend, reason) add up."""
        counts: dict[tuple[str, str], int] = {}
        for part in parts:
            for backend, reason, count in part.backends:
                counts[backend, reason] = counts.get((backend, reason), 0) + count
        return GrammarStats([(b, r, n) for (b, r), n in sorted(counts.items())])


class EngineCoreStats(msgspec.Struct, array_like=True):
    """A snapshot of the engine core's gauges and cumulative counters.

    The one stats schema: `Scheduler.make_stats` builds it from the parts' owners, the
    engine core sends it as the STATS payload, and the API server keeps it as-is for /metrics
    (`PrometheusMetrics`); under `-dp` one record is `merge`d from every engine's.
    """

    # Requests in the running batch.
    num_running: int
    # Requests queued for a slot in the batch: new, preempted, or with a grammar compiling.
    num_waiting: int
    # Preemptions since startup (cumulative).
    num_preemptions: int
    # Aborts that found the request still alive in the engine (cumulative).
    num_aborted_requests: int
    # Wall-clock time of the snapshot (time.time()), in the engine-core process.
    timestamp: float
    # The KV and prefix cache.
    kv: KVCacheStats = msgspec.field(default_factory=KVCacheStats)
    # Speculative decoding and grammar fast-forward.
    spec: SpecDecodeStats = msgspec.field(default_factory=SpecDecodeStats)
    # Grammar backends.
    grammar: GrammarStats = msgspec.field(default_factory=GrammarStats)

    def same_as(self, other: EngineCoreStats | None) -> bool:
        """True when every field but the timestamp is equal (nothing new to send)."""
        if other is None:
            return False
        return msgspec.structs.replace(other, timestamp=self.timestamp) == self

    def of_dead_engine(self) -> EngineCoreStats:
        """This snapshot once its engine is gone: nothing runs or waits and its KV cache no
        longer exists (no blocks, no usage); the cumulative counters keep their values."""
        return msgspec.structs.replace(
            self, num_running=0, num_waiting=0, kv=self.kv.of_dead_engine())

    @staticmethod
    def merge(snapshots: Sequence[EngineCoreStats]) -> EngineCoreStats:
        """One snapshot for several engines: each part merges its own way, counts add up,
        and the snapshot is as recent as the most recent one."""
        return _sum(
            EngineCoreStats, snapshots,
            timestamp=max(s.timestamp for s in snapshots),
            kv=KVCacheStats.merge([s.kv for s in snapshots]),
            spec=SpecDecodeStats.merge([s.spec for s in snapshots]),
            grammar=GrammarStats.merge([s.grammar for s in snapshots]),
        )
