"""Any OpenAI-compatible server (vLLM, SGLang's OpenAI API, OpenAI itself, another gateway).

Message-based: the request body is forwarded (with the upstream's own chat template and tool parser).
Token ids are asked for with vLLM's ``return_token_ids`` (``prompt_token_ids`` + ``choices[i].token_ids``);
a server that rejects the field is asked again without it, remembered, and its calls are marked
``retokenized``. The response parsing here is shared with the litellm adapter."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from tracegym.gateway.openai_errors import UpstreamRejected
from tracegym.gateway.proxy.upstream.base import (
    GenChoice,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    StreamEvent,
    Upstream,
)
from tracegym.gateway.proxy.upstream.http import (
    JSON_HEADERS,
    check_status,
    request_timeout,
    sse_events,
    upstream_errors,
)

log = logging.getLogger("tracegym.gateway")

# Gateway-only fields never forwarded upstream.
_DROP = {"stream", "stream_options"}


def _logprob_values(lp: Any) -> list[float] | None:
    if not isinstance(lp, dict):
        return None
    if isinstance(lp.get("content"), list):
        return [float(e["logprob"]) for e in lp["content"]]
    if isinstance(lp.get("token_logprobs"), list):
        return [float(v) for v in lp["token_logprobs"]]
    return None


def parse_choice(c: dict[str, Any], operation: str) -> GenChoice:
    ids = c.get("token_ids")
    msg = c.get("message") if operation == "chat" else None
    text = (msg or {}).get("content") if operation == "chat" else c.get("text")
    return GenChoice(
        index=int(c.get("index", 0)), output_ids=list(ids) if isinstance(ids, list) else None,
        logprobs=_logprob_values(c.get("logprobs")), text=text or "",
        message=dict(msg) if isinstance(msg, dict) else ({"content": text} if operation == "chat" else None),
        finish_reason=c.get("finish_reason"),
    )


def _weight_version(body: dict[str, Any]) -> str | None:
    meta = body.get("metadata")
    if isinstance(meta, dict) and meta.get("weight_version") is not None:
        return str(meta["weight_version"])
    return None


def parse_response(body: dict[str, Any], operation: str) -> GenerateResult:
    choices = [parse_choice(c, operation) for c in body.get("choices") or []]
    usage = body.get("usage") or {}
    prompt_ids = body.get("prompt_token_ids")
    if prompt_ids is None and choices:
        prompt_ids = (body["choices"][0] or {}).get("prompt_token_ids")
    exact = prompt_ids is not None and all(c.output_ids is not None for c in choices)
    return GenerateResult(
        choices=sorted(choices, key=lambda c: c.index), prompt_tokens=int(usage.get("prompt_tokens") or 0),
        prompt_ids=list(prompt_ids) if prompt_ids is not None else None, weight_version=_weight_version(body),
        retokenized=not exact, completion_tokens=int(usage.get("completion_tokens") or 0),
    )


def parse_stream_chunk(chunk: dict[str, Any], operation: str) -> list[StreamEvent]:
    out = []
    prompt_ids = chunk.get("prompt_token_ids")
    usage = chunk.get("usage") or {}
    for c in chunk.get("choices") or []:
        delta = (c.get("delta") or {}) if operation == "chat" else {}
        text = delta.get("content") if operation == "chat" else c.get("text")
        ids = c.get("token_ids")
        choice = GenChoice(
            index=int(c.get("index", 0)), output_ids=list(ids) if isinstance(ids, list) else None,
            logprobs=_logprob_values(c.get("logprobs")), text=text or "",
            tool_call_deltas=delta.get("tool_calls") or None, finish_reason=c.get("finish_reason"),
        )
        out.append(StreamEvent(choice=choice, prompt_tokens=usage.get("prompt_tokens"),
                               prompt_ids=list(prompt_ids) if prompt_ids else None,
                               weight_version=_weight_version(chunk)))
    if not out and usage:  # the include_usage chunk: no choices, the call's token counts
        out.append(StreamEvent(choice=None, prompt_tokens=usage.get("prompt_tokens"),
                               completion_tokens=usage.get("completion_tokens"),
                               weight_version=_weight_version(chunk)))
    return out


def forward_body(req: GenerateRequest, *, token_ids: bool) -> dict[str, Any]:
    if req.body is None:
        raise ValueError("the openai upstream forwards the request body; none was given")
    body = {k: v for k, v in req.body.items() if k not in _DROP}
    if token_ids:
        body["return_token_ids"] = True
    return body


class OpenAIUpstream(Upstream):
    kind = "openai"
    token_native = False

    def __init__(
        self, base_url: str, session: aiohttp.ClientSession, *, api_key: str | None = None,
        timeout: float = 600.0, connect_timeout: float = 10.0, health_timeout: float = 2.0,
    ) -> None:
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self._session = session
        self._headers = {**JSON_HEADERS, **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self._timeout_s = timeout
        self._timeout = request_timeout(timeout, connect_timeout)
        self._health_timeout = aiohttp.ClientTimeout(total=health_timeout)
        self.supports_token_ids: bool | None = None
        """None until the first call tells: does the server accept ``return_token_ids``?"""

    def _url(self, req: GenerateRequest) -> str:
        return self.base_url + ("/chat/completions" if req.operation == "chat" else "/completions")

    async def _post(self, req: GenerateRequest, body: dict[str, Any]) -> aiohttp.ClientResponse:
        resp = await self._session.post(self._url(req), data=orjson.dumps(body), headers=self._headers,
                                        timeout=self._timeout)
        try:
            await check_status(resp)
        except UpstreamRejected:
            resp.release()
            raise
        return resp

    async def _open(self, req: GenerateRequest, *, stream: bool) -> aiohttp.ClientResponse:
        """POST, retrying once without ``return_token_ids`` if the server rejects that field."""
        ask = self.supports_token_ids is not False
        body = forward_body(req, token_ids=ask)
        if stream:
            body["stream"], body["stream_options"] = True, {"include_usage": True}
        try:
            return await self._post(req, body)
        except UpstreamRejected as e:
            if not ask or e.upstream_status != 400 or "return_token_ids" not in e.message:
                raise
            log.info("upstream %s does not take return_token_ids; its calls are marked retokenized",
                     self.base_url)
            self.supports_token_ids = False
            body.pop("return_token_ids")
            return await self._post(req, body)

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        with upstream_errors(self._url(req), self._timeout_s):
            resp = await self._open(req, stream=False)
            async with resp:
                body = orjson.loads(await resp.read())
        result = parse_response(body, req.operation)
        if self.supports_token_ids is None:
            self.supports_token_ids = not result.retokenized
        return result

    async def stream(self, req: GenerateRequest) -> AsyncIterator[StreamEvent]:
        finished = False
        with upstream_errors(self._url(req), self._timeout_s):
            resp = await self._open(req, stream=True)
            try:
                async for chunk, more in sse_events(resp.content.readany):
                    evs = parse_stream_chunk(chunk, req.operation)
                    for i, ev in enumerate(evs):
                        ev.more = more or i < len(evs) - 1
                        yield ev
                finished = True
            finally:
                resp.release() if finished else resp.close()

    async def model_info(self) -> ModelInfo:
        url = self.base_url + "/models"
        with upstream_errors(url, self._timeout_s):
            async with self._session.get(url, headers=self._headers, timeout=self._timeout) as resp:
                await check_status(resp)
                body = orjson.loads(await resp.read())
        data = body.get("data") or []
        name = data[0].get("id") if data else None
        return ModelInfo(served_model_name=name, tokenizer_path=None, raw=body)

    async def health(self) -> dict[str, Any]:
        url = self.base_url + "/models"
        try:
            async with self._session.get(url, headers=self._headers, timeout=self._health_timeout) as resp:
                return {"reachable": resp.status == 200, "status_code": resp.status, "url": self.base_url}
        except (aiohttp.ClientError, TimeoutError) as e:
            return {"reachable": False, "error": f"{type(e).__name__}: {e}", "url": self.base_url}

    async def close(self) -> None:
        return None
