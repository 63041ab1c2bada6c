"""Re-tokenization drift per model family: over a seeded multi-turn tool corpus on each family's tiny model
(``tests/gateway/proxy/prompt/family_corpus.py``: system prompts, tool calls and results, reasoning where
the family has it), the fraction of calls whose prompt a re-tokenizing proxy would get wrong, against the
gateway's prefix reuse, and the gateway's prompt-planning time per call.

    python -m benchmarks.drift [--conversations 100] [--families chatml,qwen3,...]

Each conversation is played as a rollout: at every assistant turn the gateway plans the prompt
(``PrefixCache.plan_request``: render, tokenize, reuse the earlier calls' ids), the model "samples" the
turn as its family writes it (the family's canonical syntax, tokenized, then its stop token), the reply is
parsed as the chat route parses it and recorded, and the client sends it back in the OpenAI shape with
the next tool results or user message. A call is wrong for a re-tokenizing proxy when rendering its
messages and tokenizing them does not start with the previous call's prompt + sampled ids (what the
trainer must see to train on what was sampled); wrong for the gateway when its planned prompt does not.
Only canonical tokenizations are sampled here, so the proxy's figure is a lower bound (a model that
samples another split of the same text drifts the proxy further, never the gateway).

Planning time is the median ``plan_request`` wall time per call (render + encode + reuse), reported as a
ratio to ChatML's. Targets: gateway wrong = 0 in every family; planning time within 1.2x of ChatML's.
Figures: docs/benchmarks.md."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tests.gateway.proxy.prompt import family_corpus as corpus
from tracegym.gateway.proxy.prompt.prefix_reuse import PrefixCache
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer
from tracegym.types import CallRecord, ChoiceRecord

MODELS = {"chatml": "tiny-random", "qwen3": "qwen3-tiny", "llama3": "llama3-tiny", "gemma3": "gemma3-tiny",
          "deepseek_v3": "deepseek3-tiny", "gpt_oss": "gptoss-tiny"}


def _stop_id(tok: ChatTokenizer, calls: bool) -> int:
    f = tok.family
    name = "<|call|>" if f.name == "gpt_oss" and calls else f.stop_tokens[0]
    return tok.tokenizer.token_to_id(name)


def play(tok: ChatTokenizer, seed: int, cache: PrefixCache) -> tuple[int, int, int, list[float]]:
    """``(calls after the first, wrong for a re-tokenizing proxy, wrong for the gateway, plan seconds)``."""
    f = tok.family
    turns, offered = corpus.conversation(seed, parallel=f.parallel_calls, reasoning=f.reasoning is not None,
                                         tools=True)
    tools = corpus.TOOLS if offered else None
    names = [t["function"]["name"] for t in corpus.TOOLS]
    rid, msgs, ids_map = f"r{seed}", [], {}
    prev: tuple[list[int], list[int]] | None = None
    n = proxy_wrong = ours_wrong = 0
    times: list[float] = []
    for i, t in enumerate(turns):
        if t.role != "assistant":
            msg = corpus.openai([t])[0]
            if t.role == "tool":
                msg["tool_call_id"] = ids_map.get(t.call_id, t.call_id)
            msgs.append(msg)
            continue
        request: dict[str, Any] = {"messages": list(msgs), "tools": tools}
        t0 = time.perf_counter()
        plan = cache.plan_request(rid, request)
        times.append(time.perf_counter() - t0)
        if prev is not None:
            n += 1
            sampled_prefix = prev[0] + prev[1]
            retokenized = tok.apply(msgs, tools=tools)
            proxy_wrong += retokenized[: len(sampled_prefix)] != sampled_prefix
            ours_wrong += plan.prompt_ids[: len(sampled_prefix)] != sampled_prefix
        text = corpus.sampled(f.name, t.text, t.calls, t.reasoning)
        out = [*tok.encode(text), _stop_id(tok, bool(t.calls))]
        reasoning, rest = f.split_reasoning(text, False)
        parsed = f.parse_tools(rest, names)
        reply: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if reasoning is not None:
            reply["reasoning_content"] = reasoning
        if parsed.calls:
            reply["tool_calls"] = parsed.calls
            ids_map.update({c.id: p["id"] for c, p in zip(t.calls, parsed.calls, strict=False)})
        cache.remember(rid, CallRecord(
            call_id=f"{rid}-{i}", rollout_id=rid, operation="chat", model="m", upstream_kind="sglang",
            request=request, choices=[ChoiceRecord(0, out, [0.0] * len(out), "stop", reply)],
            prompt_ids=plan.prompt_ids, drift=plan.drift, prefix_len=plan.prefix_len))
        msgs.append(reply)
        prev = (plan.prompt_ids, out)
    return n, proxy_wrong, ours_wrong, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=100)
    ap.add_argument("--families", default=",".join(MODELS))
    args = ap.parse_args()
    from tracegym.modelfiles.prepare import prepare_model

    rows = []
    for name in args.families.split(","):
        tok = ChatTokenizer.from_dir(prepare_model(MODELS[name]))
        cache = PrefixCache(tok)
        calls = proxy = ours = 0
        times: list[float] = []
        for seed in range(args.conversations):
            n, p, o, t = play(tok, seed, cache)
            calls, proxy, ours, times = calls + n, proxy + p, ours + o, times + t
        rows.append((name, calls, proxy, ours, statistics.median(times) * 1e3))
    base = next((r[4] for r in rows if r[0] == "chatml"), None)
    print(f"{'family':<12} {'calls':>6} {'re-tokenizing wrong':>20} {'gateway wrong':>14} {'plan ms p50':>12} "
          f"{'vs chatml':>9}")
    for name, calls, proxy, ours, ms in rows:
        ratio = f"{ms / base:.2f}x" if base else "-"
        print(f"{name:<12} {calls:>6} {proxy:>6} ({proxy / max(calls, 1):6.1%}) {ours:>14} {ms:>12.3f} {ratio:>9}")
    if any(r[3] for r in rows):
        raise SystemExit("the gateway's prompts drifted from the sampled ids")


if __name__ == "__main__":
    main()
