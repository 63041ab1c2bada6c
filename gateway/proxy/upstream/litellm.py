"""Any provider through ``litellm.acompletion`` / ``litellm.atext_completion``. Calls are marked
``retokenized`` (providers return no token ids). litellm is slow to import, so it is imported
once in a thread when the app starts (``start``), never at module import."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from tracegym.gateway.openai_errors import OpenAIError, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable
from tracegym.gateway.proxy.upstream.base import (
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    StreamEvent,
    Upstream,
)
from tracegym.gateway.proxy.upstream.openai import parse_response, parse_stream_chunk

# Request fields litellm takes as keyword arguments (everything else in the body is dropped).
_FORWARD = (
    "messages", "prompt", "tools", "tool_choice", "temperature", "top_p", "n", "stop", "max_tokens",
    "max_completion_tokens", "seed", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
    "response_format", "parallel_tool_calls", "user", "logit_bias",
)


def _import_litellm() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import
    import litellm

    return litellm


def map_litellm_error(e: Exception, model: str) -> OpenAIError:
    status = getattr(e, "status_code", None)
    name = type(e).__name__
    if "Timeout" in name or status in (408, 504):
        return UpstreamTimeout(f"litellm model {model} timed out: {e}")
    if "APIConnectionError" in name or "ServiceUnavailable" in name:
        return UpstreamUnavailable(f"litellm model {model} is unreachable: {e}")
    if isinstance(status, int) and status >= 400:
        return UpstreamRejected(status, str(e))
    return UpstreamUnavailable(f"litellm model {model} failed: {name}: {e}")


class LiteLLMUpstream(Upstream):
    kind = "litellm"
    token_native = False

    def __init__(self, model: str, *, api_base: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        self.model = model
        self.api_base = api_base
        self.api_key = api_key
        self.timeout = timeout
        self._lib: Any = None

    async def start(self) -> None:
        if self._lib is None:
            self._lib = await asyncio.to_thread(_import_litellm)

    def _kwargs(self, req: GenerateRequest) -> dict[str, Any]:
        if req.body is None:
            raise ValueError("the litellm upstream forwards the request body; none was given")
        kw = {k: req.body[k] for k in _FORWARD if req.body.get(k) is not None}
        kw.update(model=self.model, timeout=self.timeout)
        if self.api_base:
            kw["api_base"] = self.api_base
        if self.api_key:
            kw["api_key"] = self.api_key
        return kw

    async def _call(self, req: GenerateRequest, **extra: Any) -> Any:
        await self.start()
        fn = self._lib.acompletion if req.operation == "chat" else self._lib.atext_completion
        try:
            return await fn(**self._kwargs(req), **extra)
        except Exception as e:  # litellm raises its own exception family; mapped to 4xx/502/504
            raise map_litellm_error(e, self.model) from e

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        resp = await self._call(req)
        result = parse_response(resp.model_dump(), req.operation)
        result.retokenized = True
        return result

    async def stream(self, req: GenerateRequest) -> AsyncIterator[StreamEvent]:
        resp = await self._call(req, stream=True)
        try:
            async for chunk in resp:
                for ev in parse_stream_chunk(chunk.model_dump(), req.operation):
                    yield ev
        except OpenAIError:
            raise
        except Exception as e:  # mid-stream provider failure
            raise map_litellm_error(e, self.model) from e

    async def model_info(self) -> ModelInfo:
        return ModelInfo(served_model_name=self.model, tokenizer_path=None)

    async def health(self) -> dict[str, Any]:
        return {"reachable": None, "note": "litellm providers are not probed", "model": self.model}

    async def close(self) -> None:
        return None
