"""POST /tokenize and POST /detokenize, in upstream vLLM's request and response shapes."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vllm.entrypoints.openai.errors import error_response, exception_error
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_engine import json_response
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.exceptions import InvalidRequestError

# The /tokenize text limit, in characters per token of max_model_len. A token of real text
# spans 3 to 5 characters on average (prose, code), and even whitespace runs and long
# repeated-symbol tokens seldom lift a whole prompt's average past 10. So 32 per token admits
# every text that could fit the context, with room for a client to still learn `count` of a
# text somewhat too long, while text many times the context (megabytes: seconds of a
# tokenizer thread that no prompt can use) is refused before any of it is tokenized.
TOKENIZE_CHARS_PER_TOKEN = 32


def tokenize_request_class(
    data: dict[str, Any],
) -> type[TokenizeChatRequest] | type[TokenizeCompletionRequest]:
    """The /tokenize request model a body asks for: chat when it has `messages`."""
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest


class OpenAIServingTokenization:
    """Turns text or a conversation into token ids, and token ids back into text."""

    def __init__(self, chat: OpenAIServingChat, models: OpenAIServingModels) -> None:
        self.chat = chat
        self.models = models
        self.tokenizer = chat.tokenizer
        self.max_model_len = chat.max_model_len
        # Ids the model can produce or read: the embedding's rows (may exceed the tokenizer's
        # own vocabulary, whose extra rows decode to nothing).
        self.vocab_size = chat.engine.model_config.vocab_size
        self.max_text_chars = self.max_model_len * TOKENIZE_CHARS_PER_TOKEN

    def _text_too_long(self, param: str, what: str, length: int) -> InvalidRequestError | None:
        """The error for a text to tokenize over max_text_chars, else None."""
        if length <= self.max_text_chars:
            return None
        return InvalidRequestError(
            param, f"{what} is {length} characters; at most {self.max_text_chars} "
            f"({TOKENIZE_CHARS_PER_TOKEN} per token of max_model_len {self.max_model_len})")

    def _check_model(self, model: str | None) -> JSONResponse | None:
        """A 404 for a `model` this server does not serve, else None."""
        if self.models.resolve(model) is None:
            return error_response(f"The model `{model}` does not exist.", 404, param="model")
        return None

    async def tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest, raw_request: Request
    ) -> Response:
        """The token ids of the request's prompt, or of its messages rendered by the chat
        template; a 400 naming the field for input that cannot be rendered or is longer
        than max_text_chars."""
        if (missing := self._check_model(request.model)) is not None:
            return missing
        if isinstance(request, TokenizeCompletionRequest) and (
                error := self._text_too_long("prompt", "the prompt",
                                             len(request.prompt))) is not None:
            return exception_error(error).response()

        def run() -> TokenizeResponse:
            if isinstance(request, TokenizeChatRequest):
                chat_request = ChatCompletionRequest.model_validate({
                    "model": request.model,
                    "messages": [m.model_dump(exclude_none=True) for m in request.messages],
                    "add_generation_prompt": request.add_generation_prompt,
                    "continue_final_message": request.continue_final_message,
                    "chat_template_kwargs": request.chat_template_kwargs,
                    "tools": (None if request.tools is None
                              else [t.model_dump(exclude_none=True) for t in request.tools]),
                })
                text, chat = self.chat.render_prompt(chat_request)
                # Only the rendered text has a length to check (the template adds to it).
                error = self._text_too_long("messages", "the rendered conversation",
                                            len(text))
                if error is not None:
                    raise error
            else:
                text, chat = request.prompt, None
            tokens = self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
            if chat is not None and (chat.images or request.mm_processor_kwargs is not None):
                # Each image counts its placeholder tokens, as the engine will see them.
                prompt = chat.prompt(text, request.mm_processor_kwargs)
                tokens, _ = self.chat.engine.processor.process_images(prompt, tokens)
            strs = (self.tokenizer.convert_ids_to_tokens(tokens)
                    if request.return_token_strs else None)
            return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len,
                                    tokens=tokens, token_strs=strs)

        try:
            # Rendering and encoding are linear in the input: off the event loop.
            return json_response(await asyncio.to_thread(run))
        except ValueError as e:
            return exception_error(e).response()

    async def detokenize(self, request: DetokenizeRequest, raw_request: Request) -> Response:
        """The text of the request's token ids; a 400 naming `tokens` for an id outside the
        vocabulary or more ids than max_model_len."""
        if (missing := self._check_model(request.model)) is not None:
            return missing
        if len(request.tokens) > self.max_model_len:
            # No prompt or output holds more; a million ids would hold the event loop.
            return error_response(
                f"tokens: at most {self.max_model_len} ids (max_model_len), got "
                f"{len(request.tokens)}", 400, param="tokens")
        for i, token in enumerate(request.tokens):
            if not 0 <= token < self.vocab_size:
                return error_response(
                    f"tokens[{i}]: {token} is not a token id of this model "
                    f"(0 to {self.vocab_size - 1})", 400, param="tokens",
                )

        def run() -> str:
            return self.tokenizer.decode(request.tokens)

        try:
            prompt = await asyncio.to_thread(run)
        except (ValueError, OverflowError, TypeError) as e:
            return exception_error(InvalidRequestError("tokens", f"cannot be decoded: {e}")).response()
        return json_response(DetokenizeResponse(prompt=prompt))
