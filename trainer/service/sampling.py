"""A Tinker ``SampleRequest`` as the service runs it: checked (``parse_sample``), turned into the gateway's
``POST /v1/completions`` body (``completion_body``) and the gateway's answer read back into the SDK's
``SampleResponse`` fields (``read_completion``).

Prompt logprobs travel as vLLM's ``prompt_logprobs`` (the gateway asks its engine for SGLang's
``input_token_logprobs``), top-k sample logprobs as the completions ``logprobs: k`` with vLLM's
``return_tokens_as_token_ids`` (so each alternative names its token id). Every logprob is the engine's: the
raw logits' log-softmax, as the sampled tokens' own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracegym.trainer.service.wire import BadInput, Sampled, SampleResult, TopK

MAX_TOP_LOGPROBS = 20
"""The most top alternatives per position the gateway returns (OpenAI's bound on ``logprobs``)."""
MAX_TOP_K = 1 << 20
"""The largest ``top_k`` the gateway takes."""
NOT_OFFERED = ("target_prompt_logprobs", "prompt_alt_tokens_k", "record_stability_info")


@dataclass(slots=True)
class SampleAsk:
    prompt: list[int]
    params: dict[str, Any]
    """The request's ``sampling_params``."""
    n: int
    prompt_logprobs: bool = False
    topk_prompt: int = 0
    topk_sample: int = 0
    last_n: int | None = None
    """Score only the last ``last_n`` prompt tokens (``prompt_logprobs_last_n``): the entries before are None."""

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_logprobs or self.topk_prompt > 0


def _count(body: dict[str, Any], key: str, hi: int) -> int:
    v = body.get(key) or 0
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise BadInput(f"{key} must be an integer in 0..{hi}, got {v!r}")
    return v


def _prompt(body: dict[str, Any]) -> list[int]:
    chunks = (body.get("prompt") or {}).get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise BadInput("prompt must be {\"chunks\": [{\"tokens\": [...]}]} with at least one token")
    prompt: list[int] = []
    for j, c in enumerate(chunks):
        if not isinstance(c, dict) or c.get("type", "encoded_text") != "encoded_text":
            raise BadInput(f"prompt.chunks[{j}]: only token chunks (encoded_text) are supported")
        prompt += [int(t) for t in c.get("tokens") or []]
    if not prompt:
        raise BadInput("prompt has no tokens")
    return prompt


def _check_params(params: dict[str, Any]) -> None:
    top_k = params.get("top_k")
    if top_k not in (-1, 0, None) and (isinstance(top_k, bool) or not isinstance(top_k, int)
                                        or not 1 <= top_k <= MAX_TOP_K):
        raise BadInput(f"sampling_params.top_k must be -1 (every token) or an integer in 1..{MAX_TOP_K}, "
                       f"got {top_k!r}")
    max_tokens = params.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise BadInput(f"sampling_params.max_tokens must be an integer >= 1, got {max_tokens!r}")


def _check_length(prompt: int, max_tokens: int | None, max_length: int, model: str) -> None:
    """``BadInput`` when a prompt of ``prompt`` tokens, or it and ``max_tokens`` sampled ones, do not fit
    the model's context of ``max_length`` tokens (0: unknown, nothing checked)."""
    if not max_length:
        return
    if prompt >= max_length:
        raise BadInput(f"the prompt has {prompt} tokens; {model}'s context is {max_length} tokens, which must "
                       f"hold the prompt and at least one sampled token: shorten the prompt to at most "
                       f"{max_length - 1}")
    if max_tokens is not None and prompt + max_tokens > max_length:
        raise BadInput(f"the prompt's {prompt} tokens and max_tokens {max_tokens} make {prompt + max_tokens}, "
                       f"more than {model}'s context of {max_length} tokens: lower max_tokens to at most "
                       f"{max_length - prompt} or shorten the prompt")


def parse_sample(body: dict[str, Any], *, max_length: int, model: str) -> SampleAsk:
    """The request ``body`` checked (``BadInput`` says what is wrong); ``max_length``: the model's context
    (0: unknown)."""
    prompt = _prompt(body)
    n = body.get("num_samples", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 128:
        raise BadInput(f"num_samples must be an integer in 1..128, got {n!r}")
    params = dict(body.get("sampling_params") or {})
    _check_params(params)
    for key in NOT_OFFERED:
        if body.get(key) not in (None, False, 0):
            raise BadInput(f"{key} is not supported by tracegym's sampler")
    _check_length(len(prompt), params.get("max_tokens"), max_length, model)
    ask = SampleAsk(prompt, params, n, prompt_logprobs=bool(body.get("prompt_logprobs")),
                    topk_prompt=_count(body, "topk_prompt_logprobs", MAX_TOP_LOGPROBS),
                    topk_sample=_count(body, "topk_sample_logprobs", MAX_TOP_LOGPROBS))
    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None:
        if not ask.prompt_logprobs:
            raise BadInput("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
        if isinstance(last_n, bool) or not isinstance(last_n, int) or not 1 <= last_n < len(prompt):
            raise BadInput(f"prompt_logprobs_last_n must be an integer in 1..{len(prompt) - 1} (the prompt "
                           f"has {len(prompt)} tokens), got {last_n!r}")
        ask.last_n = last_n
    return ask


def completion_body(ask: SampleAsk, served_model: str) -> dict[str, Any]:
    """The gateway's ``/v1/completions`` body for ``ask`` (stop token ids are cut in ``read_completion``)."""
    params = ask.params
    body: dict[str, Any] = {"model": served_model, "prompt": ask.prompt, "n": ask.n, "logprobs": ask.topk_sample,
                            "return_token_ids": True, "temperature": params.get("temperature", 1.0),
                            "top_p": params.get("top_p", 1.0)}
    for key in ("max_tokens", "seed"):
        if params.get(key) is not None:
            body[key] = params[key]
    if isinstance(params.get("top_k"), int) and params["top_k"] > 0:
        body["top_k"] = params["top_k"]
    stop = params.get("stop")
    if isinstance(stop, str):
        body["stop"] = [stop]
    elif isinstance(stop, list) and stop and not _stop_ids(params):
        body["stop"] = stop
    if ask.topk_sample:
        body["return_tokens_as_token_ids"] = True
    if ask.scores_prompt:
        body["prompt_logprobs"] = ask.topk_prompt
    return body


def _stop_ids(params: dict[str, Any]) -> set[int]:
    stop = params.get("stop")
    if isinstance(stop, list) and stop and all(isinstance(s, int) for s in stop):
        return set(stop)
    return set()


def _token_id(name: str) -> int:
    """A ``return_tokens_as_token_ids`` token name, ``token_id:{id}``."""
    return int(name.removeprefix("token_id:"))


def _sample_topk(logprobs: dict[str, Any] | None, k: int) -> TopK:
    rows: list[list[tuple[int, float]] | None] = [
        sorted(((_token_id(t), float(lp)) for t, lp in (d or {}).items()), key=lambda x: -x[1])[:k]
        for d in (logprobs or {}).get("top_logprobs") or []]
    return TopK(k, rows)


def prompt_results(ask: SampleAsk, entries: list[dict[str, Any] | None]
                   ) -> tuple[list[float | None] | None, TopK | None]:
    """The SDK's ``prompt_logprobs`` and ``topk_prompt_logprobs`` from the gateway's ``prompt_logprobs``
    (vLLM's: per prompt token ``{"<id>": {"logprob", "rank", ...}}``, None for the first), as ``ask`` asked
    for them: entries before the last ``last_n`` tokens are None."""
    if len(entries) != len(ask.prompt):
        raise RuntimeError(f"the gateway answered {len(entries)} prompt logprobs for {len(ask.prompt)} tokens")
    cut = len(ask.prompt) - ask.last_n if ask.last_n is not None else 0
    lps: list[float | None] = []
    tops: list[list[tuple[int, float]] | None] = []
    for i, (tid, entry) in enumerate(zip(ask.prompt, entries, strict=True)):
        if entry is None or i < cut:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(float(entry[str(tid)]["logprob"]))
        ranked = sorted((e["rank"], int(t), float(e["logprob"])) for t, e in entry.items()
                        if e.get("rank") is not None and e["rank"] <= ask.topk_prompt)
        tops.append([(t, lp) for _, t, lp in ranked])
    return (lps if ask.prompt_logprobs else None), (TopK(ask.topk_prompt, tops) if ask.topk_prompt else None)


def read_completion(answer: dict[str, Any], ask: SampleAsk) -> SampleResult:
    """The gateway's ``/v1/completions`` answer to ``completion_body(ask)``. A stop token other than the
    model's EOS ends a sequence after it, as Tinker's ``stop`` token ids do."""
    stop_ids = _stop_ids(ask.params)
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    seqs = []
    for ch in choices:
        tokens = list(ch["token_ids"])
        logprobs = [float(x) for x in (ch.get("logprobs") or {}).get("token_logprobs") or []]
        topk = _sample_topk(ch.get("logprobs"), ask.topk_sample) if ask.topk_sample else None
        reason = "length" if ch.get("finish_reason") == "length" else "stop"
        cut = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
        if cut is not None:  # a stop token other than the model's EOS: cut after it
            tokens, logprobs, reason = tokens[: cut + 1], logprobs[: cut + 1], "stop"
            if topk is not None:
                topk.rows = topk.rows[: cut + 1]
        seqs.append(Sampled(tokens, logprobs, reason, topk))
    result = SampleResult(seqs)
    if ask.scores_prompt:
        entries = choices[0].get("prompt_logprobs") if choices else None
        if entries is None:
            raise RuntimeError("the gateway answered no prompt_logprobs (is its upstream token-native?)")
        result.prompt_logprobs, result.topk_prompt = prompt_results(ask, entries)
    return result
