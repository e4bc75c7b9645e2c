"""Turns user input (text or token ids, chat messages, SamplingParams) into EngineCoreRequests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec

from vllm.config import VllmConfig
from vllm.exceptions import InvalidRequestError
from vllm.lora.request import LoRARequest
from vllm.lora.validation import LoRAValidator
from vllm.multimodal.inputs import ImageFeature
from vllm.multimodal.chat import ChatImages, flatten_messages
from vllm.multimodal.processor import IMAGE_PLACEHOLDER, MultiModalProcessor, prompt_images
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine import validation
from vllm.v1.engine.constraint_checker import ConstraintChecker


class InputProcessor:
    """Validates and tokenizes requests before they enter the engine core.

    `constraint_checker` compiles each constraint once here, so a bad schema, regex or
    grammar is a ValueError to the caller and never reaches the engine core.
    """

    def __init__(
        self, vllm_config: VllmConfig, tokenizer, constraint_checker: ConstraintChecker
    ) -> None:
        self.config = vllm_config
        self.tokenizer = tokenizer
        self.constraint_checker = constraint_checker
        self.max_model_len = vllm_config.model_config.max_model_len
        self.vocab_size = vllm_config.model_config.vocab_size
        self.max_n = vllm_config.scheduler_config.max_n
        self.lora_validator = LoRAValidator(vllm_config)
        # Images in prompts (None: a text-only model, which refuses them).
        self.mm_processor = MultiModalProcessor.for_model(vllm_config.model_config,
                                                          vllm_config.multimodal_config)
        # --chat-template (None: the tokenizer's own) and --default-chat-template-kwargs
        # (a request's chat_template_kwargs override them); set by the server.
        self.chat_template: str | None = None
        self.default_chat_template_kwargs: dict[str, Any] = {}

    def check_num_sequences(self, num_prompts: int, n: int) -> None:
        """Raises InvalidRequestError when `num_prompts` prompts times `n` samples exceed
        --max-n."""
        validation.check_num_sequences(num_prompts, n, self.max_n)

    def tokenize(self, prompt: str | list[int] | dict[str, Any]) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids). Raises ValueError on bad input."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError(
                    "prompt",
                    "a dict prompt needs 'prompt' or 'prompt_token_ids'"
                )
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError("prompt", "must be a string, a list of token ids, or a dict")

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """Renders chat messages with the chat template (`chat_template` when set, else the
        model's; generation prompt added unless `kwargs` say otherwise). `kwargs` are the
        template's variables, laid over `default_chat_template_kwargs`."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages", "must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise InvalidRequestError(
                    f"messages[{i}]",
                    "each message needs a 'role' and 'content'"
                )
        kwargs = {**self.default_chat_template_kwargs, **kwargs}
        kwargs.setdefault("add_generation_prompt", True)
        if self.chat_template is not None:
            kwargs.setdefault("chat_template", self.chat_template)
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    def process(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Validates one request and returns (prompt text, engine request).

        Runs every admission rule of `validation` (the offline LLM and the server both come
        through here). Raises InvalidRequestError for an empty or too-long prompt, a prompt
        plus max_tokens past max_model_len, out-of-vocabulary token ids, invalid structured
        outputs, a thinking_token_budget without a reasoning parser, and a LoRA adapter
        that is not enabled, unreadable or unfit for the model.
        The engine request carries its own copy of `params`, with the engine's fields
        filled in; `params` itself is left as it was. A dict prompt may carry `cache_salt`
        (upstream's prompt field: a non-empty string); `priority` must be 0 unless the
        engine runs --scheduling-policy priority.
        """
        if lora_request is not None:
            self.lora_validator.check(lora_request)
        self.check_num_sequences(1, params.n)
        validation.check_priority(priority, self.config.scheduler_config.policy)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        validation.check_cache_salt(cache_salt)
        text, token_ids = self.tokenize(prompt)
        token_ids, mm_features = self.process_images(prompt, token_ids)
        validation.check_prompt(token_ids, self.vocab_size, self.max_model_len)
        validation.check_stop_token_ids(params, self.vocab_size)
        if params.structured_outputs is not None:
            self.constraint_checker.validate(params.structured_outputs)
        budget = params.thinking_token_budget
        if budget is not None and self.constraint_checker.reasoning_parser is None:
            raise InvalidRequestError(
                "thinking_token_budget",
                "needs a reasoning parser to know where thinking ends (start the server "
                "with --reasoning-parser)",
            )
        params = params.clone()
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            banned = {q[0] for q in params.bad_words_token_ids if len(q) == 1}
            if params.allowed_token_ids and set(params.allowed_token_ids) <= banned:
                # Nothing could be sampled: refused here rather than sampled anyway.
                raise InvalidRequestError(
                    "allowed_token_ids", "every allowed token is banned by bad_words"
                )
        validation.check_token_ids(params, self.vocab_size)
        validation.check_fits(len(token_ids), params.max_tokens, self.max_model_len)
        return text, EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            lora_request=lora_request,
            priority=priority,
            cache_salt=cache_salt,
            mm_features=mm_features,
        )

    def chat_images(self, messages: list[Any],
                    message_names: list[str] | None = None) -> ChatImages:
        """The conversation with list contents made strings and their images loaded (an
        image part becomes the model's placeholder; multimodal/chat.py). Raises
        InvalidRequestError naming the part (under `message_names`, default messages[i]),
        also for images sent to a text-only model."""
        mm = self.config.multimodal_config
        return flatten_messages(
            messages, IMAGE_PLACEHOLDER if self.mm_processor is not None else None,
            str(self.config.model_config.served_model_name), mm.allowed_local_media_path,
            mm.allowed_media_domains, message_names)

    def process_images(
        self, prompt: object, token_ids: list[int]
    ) -> tuple[list[int], list[ImageFeature] | None]:
        """A prompt's token ids with its image placeholders expanded, and its images
        (None without any), processed under a dict prompt's `mm_processor_kwargs` when it
        has them. Raises InvalidRequestError for images or mm_processor_kwargs sent to a
        text-only model, refused mm_processor_kwargs, and images or placeholders the
        model's processor refuses."""
        images, names = prompt_images(prompt)
        kwargs = prompt.get("mm_processor_kwargs") if isinstance(prompt, dict) else None
        if self.mm_processor is None:
            if images or kwargs is not None:
                raise InvalidRequestError(
                    names[0] if images else "mm_processor_kwargs",
                    f"model {self.config.model_config.served_model_name!r} does "
                    "not take images (it is not a vision-language model)")
            return token_ids, None
        # Checked even without images: a refused key is refused whatever the prompt.
        image_config = self.mm_processor.image_config_for(kwargs)
        if not images and self.mm_processor.image_token_id not in token_ids:
            return token_ids, None
        token_ids, features = self.mm_processor.process(token_ids, images, names,
                                                        image_config=image_config)
        return token_ids, features or None


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as token sequences: as written and, when it does not start with a space,
    with one (the form it takes after another word), without duplicates."""
    seqs: list[list[int]] = []
    for word in words:
        forms = [word] if word.startswith(" ") else [word, " " + word]
        for form in forms:
            ids = tokenizer.encode(form, add_special_tokens=False)
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs


def child_requests(
    core_request: EngineCoreRequest, params: SamplingParams, child_ids: list[str]
) -> Iterator[EngineCoreRequest]:
    """The engine-core request of each of a request's samples, one per id in `child_ids`.

    Each carries the core request's parameters (with what the processor filled in, such as
    the bad words' token ids). With several samples and a seed, sample i gets seed + i.
    """
    for i, child_id in enumerate(child_ids):
        child_params = core_request.sampling_params
        if len(child_ids) > 1:
            # Each sample its own copy: the engine core fills in fields of its request's.
            child_params = child_params.clone()
            if params.seed is not None:
                # Distinct seeds, or all n samples would be the same sequence.
                # Wrapped into int64 so that seed + i never overflows the engine's seed column.
                child_params.seed = (params.seed + i + 2**63) % 2**64 - 2**63
        yield msgspec.structs.replace(
            core_request, request_id=child_id, sampling_params=child_params
        )
