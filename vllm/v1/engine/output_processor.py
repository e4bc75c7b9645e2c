"""Turns EngineCoreOutputs into RequestOutputs: detokenization, stop strings, n > 1 fan-in."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from vllm.exceptions import ErrorKind
from vllm.logprobs import Logprob, SampleLogprobs
from vllm.outputs import CompletionOutput, OutputKind, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.detokenizer import IncrementalDetokenizer, find_stop_string
from vllm.v1.engine import EngineCoreOutput


_TOKEN_TEXT_CACHE = 65536


@dataclass
class _SeqState:
    """One generated sequence (a child request when n > 1)."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    # Detokenize once, when the sequence finishes: no one reads the text before (a
    # final-only request) and no stop string has to be looked for in it.
    text_at_finish: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    # Text length already handed to a streaming consumer.
    num_streamed_chars: int = 0
    num_streamed_tokens: int = 0
    # The finish has been handed to a streaming consumer.
    finish_streamed: bool = False

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
            error_kind=self.error_kind,
        )

    def take_delta(self) -> CompletionOutput | None:
        """What changed since the last call (None: nothing to report yet).

        While unfinished, the last max(len(stop)) - 1 characters are held back when a stop
        string could still complete there and cut them off, so the deltas always concatenate
        to the final text.
        """
        done = self.finish_reason is not None
        end = len(self.text)
        if not done and self.params.stop and not self.params.include_stop_str_in_output:
            hold = max(len(s) for s in self.params.stop) - 1
            end = max(self.num_streamed_chars, end - hold)
        num_tokens = len(self.token_ids)
        if (
            end == self.num_streamed_chars
            and num_tokens == self.num_streamed_tokens
            and (not done or self.finish_streamed)
        ):
            return None
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs[self.num_streamed_tokens:]
        out = CompletionOutput(
            index=self.index,
            text=self.text[self.num_streamed_chars:end],
            token_ids=self.token_ids[self.num_streamed_tokens:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
            error_kind=self.error_kind,
        )
        self.num_streamed_chars = end
        self.num_streamed_tokens = num_tokens
        self.finish_streamed = done
        return out


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_SeqState]
    num_cached_tokens: int = 0
    kind: OutputKind = OutputKind.CUMULATIVE
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


def child_request_id(request_id: str, index: int, n: int) -> str:
    """Engine-side id of sequence `index` of a request (the id itself when n == 1)."""
    return request_id if n == 1 else f"{index}_{request_id}"


class OutputProcessor:
    """Keeps per-request text state in the front end and builds RequestOutputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # Token id -> text, for Logprob.decoded_token (bounded: cleared when full).
        self._texts: dict[int, str] = {}
        self._requests: dict[str, _RequestState] = {}
        # child id -> (parent id, seq index)
        self._children: dict[str, tuple[str, int]] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
        params: SamplingParams,
        kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> list[str]:
        """Registers a request; returns the engine-side ids of its n sequences.

        `kind` says what its RequestOutputs carry: with DELTA only the sequences that
        changed, each with only its new text, tokens and logprobs; with FINAL_ONLY there is
        one output, when every sequence has finished.
        """
        seqs = []
        ids = []
        for i in range(params.n):
            detok = None
            if params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, params.skip_special_tokens, prompt_token_ids
                )
            seqs.append(
                _SeqState(
                    index=i,
                    params=params,
                    detokenizer=detok,
                    text_at_finish=kind is OutputKind.FINAL_ONLY and not params.stop,
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                )
            )
            child = child_request_id(request_id, i, params.n)
            self._children[child] = (request_id, i)
            ids.append(child)
        self._requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, seqs, kind=kind
        )
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def abort_request(self, request_id: str) -> list[str]:
        """Forgets a request; returns the engine-side ids to abort."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        ids = [child_request_id(request_id, s.index, len(state.seqs)) for s in state.seqs]
        for child in ids:
            self._children.pop(child, None)
        return ids

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Applies one step's outputs. Returns the updated requests' outputs and the
        engine-side ids that stopped on a stop string (the engine must abort them)."""
        touched: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            parent = self._children.get(out.request_id)
            if parent is None:
                continue  # aborted here already
            state = self._requests[parent[0]]
            seq = state.seqs[parent[1]]
            if seq.finish_reason is not None:
                continue
            if out.num_cached_tokens:
                state.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                # With n > 1 every sample brings the same prompt scores: the first is kept.
                state.prompt_logprobs = [None] + [
                    self._position(ids, values, rank, seq.params.detokenize)
                    for ids, values, rank in out.prompt_logprobs
                ]
            if self._update_seq(seq, out):
                to_abort.append(out.request_id)
            if seq.finish_reason is not None:
                self._children.pop(out.request_id, None)
            touched[state.request_id] = state
        results = []
        for state in touched.values():
            finished = state.finished
            if finished:
                del self._requests[state.request_id]
            if state.kind is OutputKind.FINAL_ONLY and not finished:
                continue
            if state.kind is OutputKind.DELTA:
                completions = [c for s in state.seqs if (c := s.take_delta()) is not None]
                if not completions and not finished:
                    continue
            else:
                completions = [s.completion() for s in state.seqs]
            results.append(
                RequestOutput(
                    request_id=state.request_id,
                    prompt=state.prompt,
                    prompt_token_ids=state.prompt_token_ids,
                    outputs=completions,
                    finished=finished,
                    num_cached_tokens=state.num_cached_tokens,
                    prompt_logprobs=state.prompt_logprobs,
                )
            )
        return results, to_abort

    def _update_seq(self, seq: _SeqState, out: EngineCoreOutput) -> bool:
        """Returns True when a stop string ended the sequence (the engine still runs it)."""
        if seq.params.stop and len(out.new_token_ids) > 1:
            # Several tokens at once (kept drafts): look for stop strings after each, so the
            # output ends at the same token as it would one token per step.
            *head, tail = out.new_token_ids
            for token in head:
                part = msgspec.structs.replace(
                    out, new_token_ids=[token], finish_reason=None, stop_reason=None,
                    error=None, error_kind=None,
                )
                if self._update_one(seq, part) or seq.finish_reason is not None:
                    return not out.finished
            out = msgspec.structs.replace(out, new_token_ids=[tail])
        return self._update_one(seq, out)

    def _position(
        self, ids: list[int], lps: list[float], rank: int | None, detokenize: bool
    ) -> dict[int, Logprob]:
        """One position's Logprobs: ids[0] is the sampled token (its rank from the sampler),
        ids[1:] the top-k, most likely first (ranks 1..k)."""
        named = detokenize and self.tokenizer is not None
        entries: dict[int, Logprob] = {}
        for i, (token, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            entries[token] = Logprob(lp, i, self._token_text(token) if named else None)
        sampled = ids[0]
        entries[sampled] = Logprob(lps[0], rank, self._token_text(sampled) if named else None)
        return entries

    def _token_text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            if len(self._texts) >= _TOKEN_TEXT_CACHE:
                self._texts.clear()
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    def _update_one(self, seq: _SeqState, out: EngineCoreOutput) -> bool:
        params = seq.params
        seq.token_ids.extend(out.new_token_ids)
        if seq.logprobs is not None and out.new_logprobs is not None:
            ranks = out.new_logprobs_ranks or [None] * len(out.new_logprobs)
            for ids, lps, rank in zip(out.new_logprobs_token_ids or [], out.new_logprobs, ranks):
                seq.logprobs.append(self._position(ids, lps, rank, params.detokenize))
                seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + lps[0]
        if seq.text_at_finish:
            if out.finished and seq.detokenizer is not None:
                seq.text = seq.detokenizer.update(seq.token_ids) + seq.detokenizer.flush()
        elif seq.detokenizer is not None:
            delta = seq.detokenizer.update(out.new_token_ids)
            if out.finished:
                delta += seq.detokenizer.flush()
            seq.text += delta
            if params.stop and delta:
                hit = find_stop_string(
                    seq.text, len(delta), params.stop, params.include_stop_str_in_output
                )
                if hit is not None:
                    stop_str, keep = hit
                    seq.text = seq.text[:keep]
                    seq.finish_reason = "stop"
                    seq.stop_reason = stop_str
                    return not out.finished
        if out.finished:
            seq.finish_reason = out.finish_reason
            seq.stop_reason = out.stop_reason
            seq.error = out.error
            seq.error_kind = out.error_kind
        return False
