"""The runner's multimodal side: each step's image embeddings and M-RoPE positions, and
the encoder cache that runs the vision tower once per image.

A prompt's image is encoded whole the first time a step computes any of its placeholder
positions, and its embeddings are kept, keyed by the image's content hash, while a request
still has placeholder positions of it to compute (a prefill split into chunks, a preempted
request recomputing, a prefix-cache hit ending inside the run all take the rows they
compute from the same embeddings). Once no request needs them, they stay for reuse by
later requests with the same image, least recently used first out, up to
--encoder-cache-size rows. Encoding an image alone gives the same rows whatever else is in
the step, so a request's numbers do not depend on its batch. A pipeline stage whose model
has no vision tower builds only the M-RoPE positions.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from vllm.model_executor.models.qwen2_5_vl import MultiModalStep
from vllm.multimodal.inputs import ImageFeature
from vllm.multimodal.mrope import mrope_positions
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.input_prep import StepInputs


class EncoderCache:
    """Image embeddings by content hash. An entry some request still needs (pinned) is
    never evicted; unpinned ones are evicted least recently used first while the cache
    holds more than `budget` rows."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.pins: dict[str, set[str]] = {}
        self.rows = 0
        # Vision-tower runs so far (one per image encoded; tests and logs read it).
        self.encoder_runs = 0

    def get(self, feature: ImageFeature, req_id: str,
            encode: Callable[[ImageFeature], torch.Tensor]) -> torch.Tensor:
        """The image's embeddings [length, hidden], encoded now unless cached; pins them
        for `req_id` until `unpin`, and evicts what the budget then asks of the others."""
        key = feature.content_hash
        embeds = self.entries.get(key)
        if embeds is None:
            embeds = encode(feature)
            if embeds.shape[0] != feature.length:
                raise RuntimeError(f"the vision tower gave {embeds.shape[0]} embeddings for "
                                   f"{feature.length} placeholder tokens")
            self.encoder_runs += 1
            self.entries[key] = embeds
            self.rows += feature.length
        else:
            self.entries.move_to_end(key)
        self.pins.setdefault(key, set()).add(req_id)
        self._evict()
        return embeds

    def unpin(self, key: str, req_id: str) -> None:
        """`req_id` no longer needs the image `key`; evicts what the budget then asks."""
        holders = self.pins.get(key)
        if holders is not None:
            holders.discard(req_id)
            if not holders:
                del self.pins[key]
        self._evict()

    def _evict(self) -> None:
        for key in list(self.entries):
            if self.rows <= self.budget:
                return
            if key not in self.pins:
                self.rows -= self.entries.pop(key).shape[0]


class MultiModalInputs:
    """Builds a step's MultiModalStep for a vision-language model."""

    def __init__(self, model: torch.nn.Module, budget: int,
                 to_device: Callable[[np.ndarray], torch.Tensor]) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.merge = model.config.vision_config.spatial_merge_size
        self.cache = EncoderCache(budget)
        self.to_device = to_device
        # A pipeline stage without the vision tower takes only the M-RoPE positions.
        self.encodes = getattr(model, "visual", None) is not None
        # Request id -> content hashes it holds pins on.
        self._held: dict[str, set[str]] = {}

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Drops the pins of requests that finished or were preempted (a resumed request
        pins again as it recomputes)."""
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            for key in self._held.pop(req_id, ()):
                self.cache.unpin(key, req_id)

    def _encode(self, feature: ImageFeature) -> torch.Tensor:
        pixels = torch.from_numpy(feature.pixels().copy()).to(self.device)
        return self.model.embed_image(pixels, feature.grid_thw)

    def build(self, batch: InputBatch, inputs: StepInputs,
              positions: torch.Tensor) -> dict[str, MultiModalStep]:
        """{"mm": the step's MultiModalStep}, or {} when no scheduled request has images
        (then the model runs on plain positions, which M-RoPE reads as text). `positions`
        are the step's staged device positions: a request verified with drafts may have
        been placed after the tokens it kept there (DeviceFeedback), which its host
        positions do not know."""
        states = [batch.states[r] for r in inputs.rows]
        if not any(s.mm_features for s in states):
            return {}
        # A prompt token takes its table's position (prompts are never placed on the
        # device); a later token its device position plus its request's delta.
        prompt_at: list[np.ndarray] = []
        prompt_pos: list[np.ndarray] = []
        later_at: list[np.ndarray] = []
        later_delta: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        embeds: list[torch.Tensor] = []
        for i, state in enumerate(states):
            if not state.mm_features:
                continue
            lo, hi = int(inputs.cu[i]), int(inputs.cu[i + 1])
            start = int(inputs.starts[i])
            table, delta = self._table(state)
            index = inputs.positions[lo:hi]
            in_prompt = index < table.shape[1]
            flat = np.arange(lo, hi)
            prompt_at.append(flat[in_prompt])
            prompt_pos.append(table[:, index[in_prompt]])
            later_at.append(flat[~in_prompt])
            later_delta.append(np.full(int((~in_prompt).sum()), delta, dtype=np.int64))
            if not self.encodes:
                continue
            for feature in state.mm_features:
                first, last = max(start, feature.offset), min(start + hi - lo, feature.end)
                if first >= last:
                    continue
                image = self._get(feature, state.req_id)
                rows.append(np.arange(lo + first - start, lo + last - start))
                embeds.append(image[first - feature.offset:last - feature.offset])
                if last == feature.end:
                    self._release(feature.content_hash, state.req_id)
        if embeds:
            embed_rows = self.to_device(np.concatenate(rows).astype(np.int64))
            step_embeds = torch.cat(embeds)
        else:
            embed_rows = self.to_device(np.zeros(0, dtype=np.int64))
            step_embeds = torch.zeros(0, device=self.device)
        mrope = positions[:inputs.padded_tokens].expand(3, -1).clone()
        at = self.to_device(np.concatenate(prompt_at).astype(np.int64))
        mrope[:, at] = self.to_device(np.concatenate(prompt_pos, axis=1))
        at = self.to_device(np.concatenate(later_at).astype(np.int64))
        mrope[:, at] += self.to_device(np.concatenate(later_delta))
        return {"mm": MultiModalStep(mrope, embed_rows, step_embeds)}

    def _table(self, state: CachedRequestState) -> tuple[np.ndarray, int]:
        if state.mrope is None:
            state.mrope = mrope_positions(len(state.prompt_token_ids), state.mm_features,
                                          self.merge)
        return state.mrope

    def _get(self, feature: ImageFeature, req_id: str) -> torch.Tensor:
        self._held.setdefault(req_id, set()).add(feature.content_hash)
        return self.cache.get(feature, req_id, self._encode)

    def _release(self, key: str, req_id: str) -> None:
        held = self._held.get(req_id)
        if held is not None:
            held.discard(key)
        self.cache.unpin(key, req_id)
