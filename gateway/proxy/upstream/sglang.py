"""SGLang's native API (also served by the embedded engine): ``/generate`` with ``input_ids`` and
``return_logprob``, token-in/token-out. Output ids come from ``meta_info.output_token_logprobs``
(``[logprob, id, text]`` triples), the weight version from ``meta_info.weight_version``.

Streams are SGLang's default cumulative chunks (full ids/logprobs so far; not
``--incremental-streaming-output``); this adapter turns them into per-choice deltas.

Weight swaps (``swap.py`` runs them, ``continuation.py`` joins the pieces): a choice that comes back
with finish_reason abort because the coordinator paused generation is continued transparently, as AReaL
does: wait until the swap is over, re-post with ``input_ids = prompt + output ids so far`` and
``max_new_tokens`` lowered by the tokens already produced, same sampling parameters, then join ids,
logprobs and ``weight_versions`` spans. The client sees one response (or one uninterrupted stream).
Departures from one uninterrupted generation: a ``seed`` cannot be continued exactly (the continuation
re-seeds from the same seed at a new position), and a stop *string* that straddles the cut is not
detected. Aborts not caused by a swap (a client disconnect, an explicit ``/abort_request``) are never
continued."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import aiohttp
import orjson

from tracegym.gateway.openai_errors import UpstreamRejected, UpstreamUnavailable
from tracegym.gateway.proxy.upstream.adapter_table import AdapterTable
from tracegym.gateway.proxy.upstream.base import (
    GenChoice,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    PromptLogprobs,
    StreamEvent,
    TopLogprob,
    Upstream,
)
from tracegym.gateway.proxy.upstream.continuation import (
    MAX_CONTINUATIONS,
    JoinedChoice,
    continuation_request,
    too_many_continuations,
)
from tracegym.gateway.proxy.upstream.http import (
    JSON_HEADERS,
    BackgroundTasks,
    check_status,
    error_message,
    read_all,
    request_timeout,
    sse_events,
    upstream_errors,
)
from tracegym.gateway.proxy.upstream.keepalive import KeepAlivePool
from tracegym.gateway.proxy.upstream.swap import SwapGate

log = logging.getLogger("tracegym.gateway")

def sampling_params(req: GenerateRequest) -> dict[str, Any]:
    """OpenAI names → SGLang ``sampling_params`` (only keys that were set: SGLang 0.5.23 and the
    embedded engine reject unknown keys)."""
    s = req.sampling
    sp: dict[str, Any] = {}
    if s.max_tokens is not None:
        sp["max_new_tokens"] = s.max_tokens
    if s.temperature is not None:
        sp["temperature"] = s.temperature
    if s.top_p is not None:
        sp["top_p"] = s.top_p
    if s.stop:
        sp["stop"] = s.stop
    if s.stop_token_ids:
        sp["stop_token_ids"] = s.stop_token_ids
    if s.seed is not None:
        sp["sampling_seed"] = s.seed
    if s.frequency_penalty is not None:
        sp["frequency_penalty"] = s.frequency_penalty
    if s.presence_penalty is not None:
        sp["presence_penalty"] = s.presence_penalty
    if s.top_k is not None:
        sp["top_k"] = s.top_k
    if s.n > 1:
        sp["n"] = s.n
    return sp


def generate_payload(req: GenerateRequest, *, stream: bool, lora_path: str | None = None) -> dict[str, Any]:
    if req.input_ids is None:
        raise ValueError("the sglang upstream needs input_ids")
    payload: dict[str, Any] = {
        "input_ids": req.input_ids,
        "rid": req.rid,
        "sampling_params": sampling_params(req),
        "return_logprob": True,
        "stream": stream,
    }
    top = req.top_logprobs
    if req.prompt_logprobs is not None:
        if stream:
            raise ValueError("prompt logprobs are asked for without streaming only")
        payload["logprob_start_len"] = 0
        top = max(top, req.prompt_logprobs)  # SGLang's one top_logprobs_num: output tops are cut back to theirs
    if top:
        payload["top_logprobs_num"] = top
    if lora_path is not None:
        payload["lora_path"] = lora_path  # SGLang's name for the adapter's lora_name
    return payload


def finish_reason(meta: dict[str, Any]) -> tuple[str | None, str | None]:
    """SGLang's ``meta_info.finish_reason`` → (OpenAI finish_reason, matched stop string or None)."""
    fr = meta.get("finish_reason")
    if fr is None:
        return None, None
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    if kind == "stop":
        matched = fr.get("matched") if isinstance(fr, dict) else None
        return "stop", matched if isinstance(matched, str) else None
    if kind == "length":
        return "length", None
    if kind == "abort":
        return "abort", None
    return str(kind), None


def _ids_and_logprobs(item: dict[str, Any], start: int = 0) -> tuple[list[int], list[float] | None, int]:
    """The output ids and logprobs from position ``start`` on (only those are converted), and the total
    number of output tokens in ``item``."""
    triples = item["meta_info"].get("output_token_logprobs")
    if triples:
        new = triples[start:]
        return [int(t[1]) for t in new], [float(t[0]) for t in new], len(triples)
    ids = item.get("output_ids") or []
    return list(ids[start:]), None, len(ids)


def _top_logprobs(item: dict[str, Any], start: int = 0,
                  keep: int | None = None) -> list[list[TopLogprob]] | None:
    """The output tokens' top logprobs from position ``start`` on; ``keep``: at most that many each (0: none)."""
    tops = item["meta_info"].get("output_top_logprobs")
    if not tops or keep == 0:
        return None
    return [_tops(pos or [], keep) for pos in tops[start:]]


def _tops(triples: list[list[Any]], keep: int | None = None) -> list[TopLogprob]:
    return [TopLogprob(int(t[1]), float(t[0]), t[2] if len(t) > 2 else None) for t in triples[:keep]]


def prompt_logprobs(items: list[dict[str, Any]]) -> PromptLogprobs | None:
    """SGLang's ``input_token_logprobs`` / ``input_top_logprobs`` (asked for from prompt position 0) of the
    first item that has them (all items of a request share its prompt; one aborted before its prefill has
    none)."""
    for item in items:
        meta = item["meta_info"]
        triples = meta.get("input_token_logprobs")
        if triples:
            tops = meta.get("input_top_logprobs") or None
            return PromptLogprobs(
                token_ids=[int(t[1]) for t in triples],
                logprobs=[None if t[0] is None else float(t[0]) for t in triples],
                top=None if tops is None else [None if pos is None else _tops(pos) for pos in tops],
            )
    return None


def upstream_aborted(ch: GenChoice) -> UpstreamUnavailable:
    """An abort that was not a weight swap's pause (``/abort_request``, an engine failure): the call
    failed upstream (OpenAI has no ``abort`` finish reason), recorded as an error."""
    return UpstreamUnavailable(f"the upstream aborted the generation: {ch.error or 'no reason given'}")


def parse_item(index: int, item: dict[str, Any], top_logprobs: int | None = None) -> GenChoice:
    """One ``/generate`` item; ``top_logprobs``: the output top logprobs kept per token (None: all)."""
    meta = item["meta_info"]
    ids, lps, _ = _ids_and_logprobs(item)
    reason, matched = finish_reason(meta)
    abort_msg = meta["finish_reason"].get("message") if reason == "abort" else None
    return GenChoice(
        index=index, output_ids=ids, logprobs=lps, top_logprobs=_top_logprobs(item, keep=top_logprobs),
        text=item.get("text"), finish_reason=reason, stop_matched=matched, error=abort_msg,
    )


def parse_generate_response(body: Any, req: GenerateRequest | None = None) -> GenerateResult:
    """The result of ``/generate``; with ``req``, its prompt logprobs if it asked, and no more output top
    logprobs per token than it asked for."""
    items = body if isinstance(body, list) else [body]
    if not items:
        raise ValueError("empty /generate response")
    meta = items[0]["meta_info"]
    asked = req is not None and req.prompt_logprobs is not None
    keep = req.top_logprobs if asked else None
    return GenerateResult(
        choices=[parse_item(i, it, keep) for i, it in enumerate(items)],
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        weight_version=meta.get("weight_version"),
        prompt_logprobs=prompt_logprobs(items) if asked else None,
    )


class _CumulativeToDelta:
    """Per-choice bookkeeping that turns SGLang's cumulative stream chunks into deltas (converting only
    the new tokens of each chunk: the whole output every chunk would be quadratic)."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}

    def delta(self, item: dict[str, Any], *, more: bool = False) -> StreamEvent:
        index = int(item.get("index", 0))
        meta = item["meta_info"]
        start = self.seen.get(index, 0)
        ids, lps, self.seen[index] = _ids_and_logprobs(item, start)
        reason, matched = finish_reason(meta)
        choice = GenChoice(
            index=index, output_ids=ids, logprobs=lps, top_logprobs=_top_logprobs(item, start),
            finish_reason=reason,
            stop_matched=matched,
            error=meta["finish_reason"].get("message") if reason == "abort" else None,
        )
        return StreamEvent(
            choice=choice, prompt_tokens=meta.get("prompt_tokens"), weight_version=meta.get("weight_version"),
            more=more,
        )


def _holds(later: dict[str, Any], earlier: dict[str, Any]) -> bool:
    """Whether the cumulative stream event ``later`` holds all that ``earlier`` said: the same choice, not
    finished before it, the same weight version (tokens of another version are delivered with their own)."""
    meta, before = later.get("meta_info") or {}, earlier.get("meta_info") or {}
    return (later.get("index", 0) == earlier.get("index", 0) and before.get("finish_reason") is None
            and meta.get("weight_version") == before.get("weight_version"))


class SGLangUpstream(Upstream):
    kind = "sglang"
    token_native = True

    def __init__(
        self, base_url: str, session: aiohttp.ClientSession, *, timeout: float = 600.0,
        connect_timeout: float = 10.0, health_timeout: float = 2.0, api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._headers = JSON_HEADERS | auth
        """Every request's headers: the server's key (SGLang's ``--api-key``, the embedded engine's
        ``TRACEGYM_ENGINE_API_KEY``) when it has one."""
        self._get_headers = auth
        self._session = session
        self._timeout_s = timeout
        self._timeout = request_timeout(timeout, connect_timeout)
        self._health_timeout = aiohttp.ClientTimeout(total=health_timeout)
        self._bg = BackgroundTasks()
        self._pool = KeepAlivePool(self.base_url, connect_timeout=connect_timeout, read_timeout=timeout, api_key=api_key) \
            if self.base_url.startswith("http://") else None
        """``/generate``, whole and streamed (``keepalive.py``); https and everything else use aiohttp."""
        self.gate = SwapGate()
        """Read to tell swap-aborts (continued) from other aborts; driven by ``swap.SwapCoordinator``."""
        self.adapters = AdapterTable()
        """Which LoRA adapter serves which agent; switched by ``swap.SwapCoordinator.update_lora``."""

    async def _lora_path(self, req: GenerateRequest) -> str | None:
        """The served name of the call's adapter. A LoRA call waits out a running swap before it is
        posted, so it never reaches the engine under a name the swap is about to unload."""
        if req.adapter is None:
            return None
        await self.gate.wait_idle()
        return self.adapters.served_name(req.adapter)

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        """The whole result; cancelled (the client went away), the generation is aborted upstream too."""
        try:
            return await self._generate(req)
        except asyncio.CancelledError:
            self._bg.spawn(self.abort(req.rid))
            raise

    async def _generate(self, req: GenerateRequest) -> GenerateResult:
        ticket = self.gate.ticket()
        result = await self._generate_once(req)
        aborted = [c for c in result.choices if c.finish_reason == "abort"]
        if not aborted:
            return result
        if not self.gate.is_pause_abort(ticket):
            raise upstream_aborted(aborted[0])
        joined = await asyncio.gather(*(self._continue(req, c, result.weight_version) for c in aborted))
        by_index = {j.index: (j, c) for j, c, _ in joined}
        result.choices = [by_index[c.index][1] if c.index in by_index else c for c in result.choices]
        versions = [j.spans[-1].version for j, _, _ in joined if j.spans]
        result.weight_version = versions[-1] if versions else result.weight_version
        if result.prompt_logprobs is None:  # every choice was aborted before its prefill
            result.prompt_logprobs = next((p for _, _, p in joined if p is not None), None)
        return result

    async def _continue(self, req: GenerateRequest, first: GenChoice,
                        version: str | None) -> tuple[JoinedChoice, GenChoice, PromptLogprobs | None]:
        """Re-post a swap-aborted choice until it finishes (non-stream); also the prompt logprobs of a
        re-post that asked for them (``continuation_request``)."""
        joined = JoinedChoice(first.index)
        joined.add(first, version)
        prompt_lps = None
        while joined.continuations < MAX_CONTINUATIONS:
            joined.continuations += 1
            await self.gate.wait_idle()
            sub = continuation_request(req, joined)
            if sub is None:
                return joined, joined.final("length", None), prompt_lps
            ticket = self.gate.ticket()
            res = await self._generate_once(sub)
            prompt_lps = prompt_lps or res.prompt_logprobs
            part = res.choices[0]
            joined.add(part, res.weight_version)
            if part.finish_reason != "abort" or not self.gate.is_pause_abort(ticket):
                if part.finish_reason == "abort":
                    raise upstream_aborted(part)
                return joined, joined.final(part.finish_reason, part.stop_matched), prompt_lps
        raise too_many_continuations(req.rid)

    async def _generate_once(self, req: GenerateRequest) -> GenerateResult:
        url = self.base_url + "/generate"
        payload = generate_payload(req, stream=False, lora_path=await self._lora_path(req))
        if self._pool is not None:
            status, raw = await self._pool.post_json("/generate", orjson.dumps(payload))
            if status >= 400:
                raise UpstreamRejected(status, error_message(raw.decode(errors="replace")[:1000]))
            return parse_generate_response(orjson.loads(raw), req)
        with upstream_errors(url, self._timeout_s):
            async with self._session.post(
                url, data=orjson.dumps(payload), headers=self._headers,
                timeout=self._timeout,
            ) as resp:
                await check_status(resp)
                body = orjson.loads(await resp.read())
        return parse_generate_response(body, req)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[StreamEvent]:
        ticket = self.gate.ticket()
        joined: dict[int, JoinedChoice] = {}
        pending: list[JoinedChoice] = []
        async with aclosing(self._stream_once(req)) as events:
            async for ev in events:
                out = self._track(ev, joined.setdefault(ev.choice.index, JoinedChoice(ev.choice.index)),
                                  ticket, pending)
                if out is not None:
                    yield out
        for j in pending:  # one choice at a time: only n > 1 streams have several
            async for ev in self._continue_stream(req, j):
                yield ev

    def _track(self, ev: StreamEvent, j: JoinedChoice, ticket: int,
               pending: list[JoinedChoice]) -> StreamEvent | None:
        """Account a delta; a swap-abort becomes a plain delta and queues the choice for continuation."""
        ch = ev.choice
        j.add(ch, ev.weight_version)
        if ch.finish_reason == "abort":
            if not self.gate.is_pause_abort(ticket):
                raise upstream_aborted(ch)
            pending.append(j)
            ch.finish_reason = ch.error = None
            ev.more = False  # its tokens go out now: the continuation waits for the swap
            return ev if ch.output_ids else None
        if ch.finish_reason is not None and j.continuations:
            ch.weight_versions = list(j.spans)
        return ev

    async def _continue_stream(self, req: GenerateRequest, j: JoinedChoice) -> AsyncIterator[StreamEvent]:
        while j.continuations < MAX_CONTINUATIONS:
            j.continuations += 1
            await self.gate.wait_idle()
            sub = continuation_request(req, j)
            if sub is None:
                yield StreamEvent(choice=dataclasses.replace(j.final("length", None), output_ids=[], logprobs=[],
                                                             top_logprobs=None, text=""))
                return
            ticket, again = self.gate.ticket(), []
            async with aclosing(self._stream_once(sub)) as events:
                async for ev in events:
                    ev.choice.index, ev.prompt_tokens = j.index, None  # the client's prompt did not grow
                    out = self._track(ev, j, ticket, again)
                    if out is not None:
                        yield out
            if not again:
                return
        raise too_many_continuations(req.rid)

    async def post_control(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """POST a control endpoint (the swap sequences' steps, driven only by ``swap.SwapCoordinator``):
        (HTTP status, JSON body; a text body becomes ``{"message": text}``). Error statuses are returned,
        not raised; an unreachable upstream raises 502/504."""
        url = self.base_url + path
        with upstream_errors(url, self._timeout_s):
            async with self._session.post(url, data=orjson.dumps(body), headers=self._headers,
                                          timeout=self._timeout) as resp:
                raw = await resp.read()
                status = resp.status
        try:
            parsed = orjson.loads(raw) if raw.strip() else {}
        except orjson.JSONDecodeError:
            parsed = {"message": raw.decode(errors="replace")[:1000]}
        return status, parsed if isinstance(parsed, dict) else {"message": str(parsed)}

    async def _stream_once(self, req: GenerateRequest) -> AsyncIterator[StreamEvent]:
        """One ``/generate`` stream as deltas. SGLang's events are cumulative: of one choice's events received
        in one read (the gateway behind the engine) only the last becomes a delta, one delta for their tokens
        instead of one per token, unless the weight version changed between them (``_holds``)."""
        url = self.base_url + "/generate"
        converter = _CumulativeToDelta()
        finished = False
        body = orjson.dumps(generate_payload(req, stream=True, lora_path=await self._lora_path(req)))
        with upstream_errors(url, self._timeout_s):
            if self._pool is not None:
                answer = await self._pool.post_stream("/generate", body)
                status, read, release, drop = answer.status, answer.read, answer.finish, answer.finish
            else:
                resp = await self._session.post(url, data=body, headers=self._headers, timeout=self._timeout)
                status, read, release, drop = resp.status, resp.content.readany, resp.release, resp.close
            try:
                if status >= 400:
                    raise UpstreamRejected(status, error_message(await read_all(read, 1000)))
                held: dict[str, Any] | None = None
                async for item, more in sse_events(read):
                    if held is not None and not _holds(item, held):
                        yield converter.delta(held, more=True)
                    held = item if more and req.sampling.n == 1 else None
                    if held is None:  # else the next event, received with this one, holds it all
                        yield converter.delta(item, more=more)
                if held is not None:  # the last event, received with the stream's end
                    yield converter.delta(held, more=True)
                finished = True
            finally:
                if not finished:  # consumer went away or the stream broke: stop the generation upstream
                    drop()
                    self._bg.spawn(self.abort(req.rid))
                else:
                    release()

    async def model_info(self) -> ModelInfo:
        url = self.base_url + "/model_info"
        with upstream_errors(url, self._timeout_s):
            async with self._session.get(url, headers=self._get_headers, timeout=self._timeout) as resp:
                await check_status(resp)
                body = orjson.loads(await resp.read())
        return ModelInfo(
            served_model_name=body.get("served_model_name"), tokenizer_path=body.get("tokenizer_path"),
            model_path=body.get("model_path"), weight_version=body.get("weight_version"), raw=body,
        )

    async def health(self) -> dict[str, Any]:
        url = self.base_url + "/health"
        try:
            async with self._session.get(url, headers=self._get_headers, timeout=self._health_timeout) as resp:
                return {"reachable": resp.status == 200, "status_code": resp.status, "url": self.base_url}
        except (aiohttp.ClientError, TimeoutError) as e:
            return {"reachable": False, "error": f"{type(e).__name__}: {e}", "url": self.base_url}

    async def abort(self, rid: str) -> None:
        url = self.base_url + "/abort_request"
        try:
            async with self._session.post(url, data=orjson.dumps({"rid": rid}), headers=self._headers,
                                          timeout=self._health_timeout) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("abort of %s at %s failed: %s", rid, url, e)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        await self._bg.close()
