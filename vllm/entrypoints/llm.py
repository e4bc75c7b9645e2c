"""The offline API: `LLM(...).generate(prompts, sampling_params)` and `LLM.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from vllm import thread_policy
from vllm.exceptions import InvalidRequestError
from vllm.lora.request import LoRARequest
from vllm.outputs import OutputKind, RequestOutput
from vllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.reader import Metric

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """An engine in this process. `LLM()` with no model runs the built-in demo model.

    `model` is a directory, a .gguf file, a demo model name or a hub id `ORG/NAME`
    (default: the embedded SmolLM2-135M-Instruct). Keyword arguments are
    EngineArgs fields (max_model_len, max_num_seqs, async_scheduling (on by default),
    revision, tokenizer_mode, structured_outputs_config as a dict or StructuredOutputsConfig,
    ...).
    Raises ValueError for invalid options or an unusable model directory.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        # First: OpenMP reads its wait policy once, when torch (imported below) loads it.
        thread_policy.configure_process()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.llm_engine: LLMEngine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (temperature, top_p,
        top_k, min_p, repetition_penalty; see --generation-config), as upstream's."""
        return SamplingParams(**self.llm_engine.vllm_config.model_config.sampling_defaults)

    def get_tokenizer(self) -> Any:
        """The engine's Hugging Face (fast) tokenizer, as upstream's `LLM.get_tokenizer()`."""
        return self.llm_engine.tokenizer

    def get_metrics(self) -> list[Metric]:
        """This engine's metrics as upstream's `vllm.v1.metrics.reader` objects (Counter,
        Gauge, Histogram, Vector), read from this engine's own stats: token counters, the
        request latency and token histograms, and the engine core's gauges and counters."""
        return self.llm_engine.get_metrics()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates completions for the prompts, in prompt order.

        `lora_request` runs every prompt with one adapter, or each with its own (a list,
        one per prompt; None entries use the base model); it needs `enable_lora=True`.
        `priority` (one per prompt, lower first) orders them when the engine runs
        `scheduling_policy="priority"`; a dict prompt may carry `cache_salt`.

        Every prompt is validated before any is queued, by the rules the server applies
        (`vllm/v1/engine/validation.py`), so a ValueError leaves the engine as it was. Among
        them: the prompt's tokens plus `max_tokens` must fit in `max_model_len` (leave
        `max_tokens=None` to generate until the context is full).
        That includes each structured-output constraint, compiled here (blocking) within
        `--structured-outputs-config.compile_timeout_s` of compiling: a constraint over the
        configured limits, unsatisfiable, invalid, or slower to compile than that raises
        ValueError naming the field (a compile past the limit finishes in a background
        thread; its result is cached).
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompts)} prompts"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise InvalidRequestError(
                "priority", f"got {len(priorities)} priorities for {len(prompts)} prompts")
        return self._run(prompts, params_list, use_tqdm, loras, priorities)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of conversations (with an
        adapter, or one per conversation, as in `generate`). A message's content may be a
        list of parts: text, image_url (data: URLs; file: and http(s): as the engine's
        allowed_local_media_path / allowed_media_domains permit) and image_pil (a PIL
        image), for a vision-language model, whose images `mm_processor_kwargs` sizes
        (min_pixels, max_pixels) over the engine's settings."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        processor = self.llm_engine.processor
        prompts: list[Prompt] = []
        for conversation in conversations:
            if any(isinstance(m, dict) and isinstance(m.get("content"), list)
                   and any(not isinstance(p, dict) or p.get("type") != "text"
                           for p in m["content"]) for m in conversation):
                chat = processor.chat_images(conversation)
                text = processor.apply_chat_template(chat.messages, **template_kwargs)
                prompts.append(chat.prompt(text, mm_processor_kwargs))
            else:
                text = processor.apply_chat_template(conversation, **template_kwargs)
                prompts.append(text if mm_processor_kwargs is None else
                               {"prompt": text, "mm_processor_kwargs": mm_processor_kwargs})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(
        self,
        prompts: list[Prompt],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
        priorities: list[int],
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        # Validate everything first so a bad prompt queues nothing.
        processed = [
            engine.processor.process(
                str(next(self._counter)), prompt, params, lora_request=lora, priority=priority
            )
            for prompt, params, lora, priority in zip(prompts, params_list, loras, priorities)
        ]
        ids = [core.request_id for _, core in processed]
        try:
            for (text, core), params in zip(processed, params_list):
                # Only finished outputs are returned: the engine builds no others.
                engine.add_processed_request(text, core, params, OutputKind.FINAL_ONLY)
            finished: dict[str, RequestOutput] = {}
            bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
            bar.close()
        except BaseException:
            engine.abort_request(ids)
            raise
        return [finished[i] for i in ids]

    def shutdown(self) -> None:
        """Stops the engine and its workers."""
        self.llm_engine.shutdown()

    def __del__(self) -> None:
        try:
            self.llm_engine.shutdown()
        except Exception:
            pass
