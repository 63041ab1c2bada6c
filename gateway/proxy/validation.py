"""Parsing and validating OpenAI request bodies by hand (orjson + small checks, no big pydantic models on
the hot path). Every problem is a 400 in OpenAI's error shape naming the offending parameter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from tracegym.gateway.openai_errors import bad_request
from tracegym.gateway.proxy.prompt.templating import check_template_kwargs
from tracegym.gateway.proxy.upstream.base import Operation, SamplingParams
from tracegym.types import Api

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
_MISSING = object()


@dataclass(slots=True)
class ParsedRequest:
    operation: Operation
    body: dict[str, Any]
    model: str
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    prompt: str | list[int] | None = None
    return_token_ids: bool = False
    """vLLM's ``return_token_ids``: answer ``prompt_token_ids`` and ``choices[i].token_ids`` too."""
    tokens_as_ids: bool = False
    """vLLM's ``return_tokens_as_token_ids``: logprob entries name their token ``token_id:{id}``."""
    prompt_logprobs: int | None = None
    """vLLM's ``prompt_logprobs`` (completions): the prompt tokens' logprobs, with this many top alternatives
    each, in ``choices[i].prompt_logprobs``."""
    template_kwargs: dict[str, Any] | None = None
    """``chat_template_kwargs``, checked (an object without the keys the request itself sets)."""
    api: Api = "chat"
    """The public API the request came in through (``CallRecord.api``)."""
    source: dict[str, Any] | None = None
    """Responses/Messages: the body as the client sent it; ``body`` is then the Chat Completions body it was
    translated to (what upstreams and prefix reuse read) and the record keeps both."""

    separate_reasoning: bool = True
    """SGLang's ``separate_reasoning``: a reasoning template's ``<think>`` block comes back as
    ``reasoning_content`` (chat; the Responses and Messages APIs always separate it)."""

    @property
    def parse_tools(self) -> bool:
        """Whether the reply's tool-call syntax is turned into ``tool_calls``."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_names(self) -> frozenset[str] | None:
        """The names a parsed call may have (a call to any other tool stays text)."""
        if not self.tools:
            return None
        return frozenset(t["function"]["name"] for t in self.tools if isinstance(t.get("function"), dict))


JSON_MAX_DEPTH = 64
"""The deepest nesting of arrays and objects a request body may have (the body itself is level 1): a body
is refused (400) before any generation rather than generated and then found unencodable in its span
(orjson encodes at most 254 levels). The control API's JSON values share it."""


def _too_deep(value: dict | list, depth: int, limit: int) -> bool:
    """Recursive, but never past ``limit`` + 1 frames (a hostile nesting stops at the limit)."""
    if depth > limit:
        return True
    for x in value.values() if type(value) is dict else value:
        t = type(x)
        if (t is dict or t is list) and _too_deep(x, depth + 1, limit):
            return True
    return False


def json_depth_problem(value: Any, limit: int = JSON_MAX_DEPTH) -> str | None:
    """Why ``value`` nests too deep (None: it does not)."""
    if isinstance(value, dict | list) and _too_deep(value, 1, limit):
        return f"JSON nested deeper than {limit} levels"
    return None


def load_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, nesting at most ``JSON_MAX_DEPTH`` levels (walked only when the body
    holds enough brackets to reach it: a count at C speed spares the walk of most bodies)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if raw.count(b"{") + raw.count(b"[") > JSON_MAX_DEPTH:
        problem = json_depth_problem(body)
        if problem is not None:
            raise bad_request(f"request body is {problem}")
    return body


def _get(body: dict, key: str, types: type | tuple[type, ...], what: str) -> Any:
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        return None
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad_request(f"'{key}' must be {what}, got a boolean", key)
    if not isinstance(v, types):
        raise bad_request(f"'{key}' must be {what}, got {type(v).__name__}", key)
    return v


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    v = _get(body, key, (int, float), "a number")
    if v is not None and not lo <= v <= hi:
        raise bad_request(f"'{key}' must be between {lo:g} and {hi:g}, got {v}", key)
    return None if v is None else float(v)


def _integer(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = _get(body, key, int, "an integer")
    if v is not None and (v < lo or (hi is not None and v > hi)):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise bad_request(f"'{key}' must be {bound}, got {v}", key)
    return v


def _boolean(body: dict, key: str) -> bool:
    return bool(_get(body, key, bool, "a boolean"))


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        if len(v) > 16:
            raise bad_request("'stop' takes at most 16 strings", "stop")
        return [s for s in v if s]
    raise bad_request("'stop' must be a string or a list of strings", "stop")


def _model(body: dict) -> str:
    m = body.get("model")
    if not isinstance(m, str) or not m:
        raise bad_request("'model' is required and must be a non-empty string", "model")
    return m


LOGIT_BIAS_MAX = 300
"""Entries a ``logit_bias`` may have (OpenAI's own bound)."""


def _unused_sampling(body: dict) -> None:
    """Bounds on the sampling fields the gateway does not use itself but an OpenAI-compatible upstream
    would receive as sent: ``best_of`` other than 1 and beam search are refused (one call, one sample per
    choice), ``logit_bias`` is at most ``LOGIT_BIAS_MAX`` entries of -100..100, ``min_tokens`` and
    ``prompt_logprobs`` are bounded integers (completions read ``prompt_logprobs`` too: ``parse_completion``)."""
    best_of = _integer(body, "best_of", 1)
    if best_of is not None and best_of != 1:
        raise bad_request("'best_of' is not supported: only 1 (ask for 'n' choices instead)", "best_of")
    if _get(body, "use_beam_search", bool, "a boolean"):
        raise bad_request("'use_beam_search' is not supported", "use_beam_search")
    bias = _get(body, "logit_bias", dict, "an object")
    if bias is not None:
        if len(bias) > LOGIT_BIAS_MAX:
            raise bad_request(f"'logit_bias' takes at most {LOGIT_BIAS_MAX} entries", "logit_bias")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and -100 <= v <= 100
                   for v in bias.values()):
            raise bad_request("'logit_bias' values must be numbers between -100 and 100", "logit_bias")
    _integer(body, "min_tokens", 0, 1 << 20)
    _integer(body, "prompt_logprobs", 0, 20)


def _sampling(body: dict, *, max_key_first: str | None) -> SamplingParams:
    max_tokens = _integer(body, max_key_first, 1) if max_key_first else None
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    _unused_sampling(body)
    top_k = _integer(body, "top_k", -1, 1 << 20)
    return SamplingParams(
        top_k=top_k if top_k is not None and top_k > 0 else None,  # -1 and 0: all tokens, as vLLM
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        stop=_stop(body),
        seed=_integer(body, "seed", -(2**63), 2**63 - 1),
        n=_integer(body, "n", 1, 128) or 1,
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0),
    )


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _boolean(body, "stream")
    opts = _get(body, "stream_options", dict, "an object")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        include_usage = _boolean(opts, "include_usage")
    return stream, include_usage


def _messages(body: dict) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # a dict or list role is unhashable
            raise bad_request(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}",
                              f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise bad_request(f"messages[{i}].content must be a string, a list of parts or null",
                              f"messages[{i}].content")
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            raise bad_request(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
    return msgs


def _tools(body: dict) -> tuple[list[dict[str, Any]] | None, Any]:
    tools = _get(body, "tools", list, "a list")
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                              f"tools[{i}]")
    choice = body.get("tool_choice")
    if choice is not None:
        named = isinstance(choice, dict) and isinstance(choice.get("function"), dict)
        if choice not in ("none", "auto", "required") and not named:
            raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or a named function",
                              "tool_choice")
        if choice != "none" and not tools:
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
    return tools or None, choice


def parse_chat(body: dict[str, Any]) -> ParsedRequest:
    model = _model(body)
    messages = _messages(body)
    tools, tool_choice = _tools(body)
    logprobs = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, 20) or 0
    if top and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    stream, include_usage = _stream_flags(body)
    try:
        template_kwargs = check_template_kwargs(body.get("chat_template_kwargs"))
    except ValueError as e:
        raise bad_request(str(e), "chat_template_kwargs") from e
    return ParsedRequest(
        operation="chat", body=body, model=model, template_kwargs=template_kwargs,
        sampling=_sampling(body, max_key_first="max_completion_tokens"), stream=stream,
        include_usage=include_usage, logprobs=logprobs, top_logprobs=top, messages=messages, tools=tools,
        tool_choice=tool_choice, return_token_ids=_boolean(body, "return_token_ids"),
        tokens_as_ids=_boolean(body, "return_tokens_as_token_ids"),
        separate_reasoning=_get(body, "separate_reasoning", bool, "a boolean") is not False,
    )


def _prompt(body: dict) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
        return p
    if isinstance(p, list) and p and all(isinstance(x, str | list) for x in p):
        raise bad_request("batched prompts are not supported: send one prompt per request", "prompt")
    raise bad_request("'prompt' must be a string or a non-empty list of token ids", "prompt")


def parse_completion(body: dict[str, Any]) -> ParsedRequest:
    model = _model(body)
    prompt = _prompt(body)
    if _boolean(body, "echo"):
        raise bad_request("'echo' is not supported", "echo")
    if body.get("suffix"):
        raise bad_request("'suffix' is not supported", "suffix")
    top = _integer(body, "logprobs", 0, 20)
    stream, include_usage = _stream_flags(body)
    prompt_logprobs = _integer(body, "prompt_logprobs", 0, 20)
    if prompt_logprobs is not None and stream:
        raise bad_request("'prompt_logprobs' is not supported with 'stream': true", "prompt_logprobs")
    return ParsedRequest(
        operation="text_completion", api="completions", body=body, model=model,
        sampling=_sampling(body, max_key_first=None),
        stream=stream, include_usage=include_usage, logprobs=top is not None, top_logprobs=top or 0,
        prompt=prompt, return_token_ids=_boolean(body, "return_token_ids"),
        tokens_as_ids=_boolean(body, "return_tokens_as_token_ids"), prompt_logprobs=prompt_logprobs,
    )
