"""Re-tokenization drift per model family, and the gateway's per-call cost per family: over a seeded multi-turn
tool corpus on each family's tiny model (``tests/gateway/proxy/prompt/family_corpus.py``: system prompts,
tool calls and results, reasoning where the family has it), the fraction of calls whose prompt a
re-tokenizing proxy would get wrong, against the gateway's prefix reuse; and what the gateway spends per
call on the family's prompt and reply: planning the prompt and reading the reply.

    python -m benchmarks.drift [--conversations 100] [--rounds 3] [--families chatml,qwen3,...] [--profile 15]

Each conversation is played as a rollout: at every assistant turn the gateway plans the prompt
(``PrefixCache.plan_request``: render, tokenize, reuse the earlier calls' ids), the model "samples" the
turn as its family writes it (the family's canonical syntax, tokenized, then its stop token), the reply is
read as the chat route reads it (``split_reasoning`` then ``parse_tools``) and recorded, and the client sends
it back in the OpenAI shape with the next tool results or user message. A call is wrong for a re-tokenizing
proxy when rendering its messages and tokenizing them does not start with the previous call's prompt +
sampled ids (what the trainer must see to train on what was sampled); wrong for the gateway when its
planned prompt does not. Only canonical tokenizations are sampled here, so the proxy's figure is a lower
bound (a model that samples another split of the same text drifts the proxy further, never the gateway).

Per-call cost is the CPU time of this thread (``time.thread_time``: on a shared machine, other processes'
load does not count, as wall time would) of planning the prompt and reading the reply, median per family;
each conversation is played in every family in turn (so a change in the machine's load meets them alike),
each round on new conversations (later rounds meet the memos a serving gateway has warm: the same tools,
the same system prompt), and the ratio to ChatML's is taken per round: its median and spread over the
rounds are printed. Target: gateway wrong = 0 in every
family; per-call cost within 1.2x of ChatML's. ``--profile N``: the N functions with the most own time on
the per-call path, per family (cProfile; a run of its own). Figures: docs/benchmarks.md."""

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


def play(tok: ChatTokenizer, seed: int, cache: PrefixCache,
         plans: list[tuple[list[int], str]] | None = None) -> tuple[int, int, int, list[float]]:
    """``(calls after the first, wrong for a re-tokenizing proxy, wrong for the gateway, per-call CPU seconds
    of planning the prompt and reading the reply)``; each call's ``(prompt ids, drift)`` appended to
    ``plans`` when given."""
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
        t0 = time.thread_time()
        plan = cache.plan_request(rid, request)
        spent = time.thread_time() - t0
        if plans is not None:
            plans.append((plan.prompt_ids, plan.drift))
        if prev is not None:
            n += 1
            sampled_prefix = prev[0] + prev[1]
            retokenized = tok.apply(msgs, tools=tools)
            proxy_wrong += retokenized[: len(sampled_prefix)] != sampled_prefix
            ours_wrong += plan.prompt_ids[: len(sampled_prefix)] != sampled_prefix
        text = corpus.sampled(f.name, t.text, t.calls, t.reasoning)
        out = [*tok.encode(text), _stop_id(tok, bool(t.calls))]
        t0 = time.thread_time()
        reasoning, rest = f.split_reasoning(text, False)
        parsed = f.parse_tools(rest, names)
        times.append(spent + time.thread_time() - t0)
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


def _profile(tok: ChatTokenizer, seeds: range, top: int) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile(time.thread_time)  # this thread's CPU time: other processes' load is left out
    cache = PrefixCache(tok)
    prof.enable()
    for seed in seeds:
        play(tok, seed, cache)
    prof.disable()
    print(f"--- {tok.family.name}: the {top} functions with the most own time (the proxy's re-tokenizing included)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=100, help="per family and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--families", default=",".join(MODELS))
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    args = ap.parse_args()
    from tracegym.modelfiles.prepare import prepare_model

    names = args.families.split(",")
    toks = {name: ChatTokenizer.from_dir(prepare_model(MODELS[name])) for name in names}
    if args.profile:
        for name in names:
            _profile(toks[name], range(args.conversations), args.profile)
        return
    caches = {name: PrefixCache(toks[name]) for name in names}
    totals = {name: [0, 0, 0] for name in names}
    medians: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        times: dict[str, list[float]] = {name: [] for name in names}
        for seed in range(r * args.conversations, (r + 1) * args.conversations):
            k = seed % len(names)
            for name in names[k:] + names[:k]:  # conversation by conversation, each starting elsewhere
                n, p, o, t = play(toks[name], seed, caches[name])
                totals[name] = [totals[name][0] + n, totals[name][1] + p, totals[name][2] + o]
                times[name] += t
        for name in names:
            medians[name].append(statistics.median(times[name]))
    base = medians.get("chatml")
    print(f"{'family':<12} {'calls':>6} {'re-tokenizing wrong':>20} {'gateway wrong':>14} {'per call ms p50':>16} "
          f"{'vs chatml (rounds)':>24}")
    for name in names:
        calls, proxy, ours = totals[name]
        ms = statistics.median(medians[name]) * 1e3
        if base:
            ratios = sorted(m / b for m, b in zip(medians[name], base, strict=True))
            ratio = f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"
        else:
            ratio = "-"
        print(f"{name:<12} {calls:>6} {proxy:>6} ({proxy / max(calls, 1):6.1%}) {ours:>14} {ms:>16.3f} {ratio:>24}")
    if any(t[2] for t in totals.values()):
        raise SystemExit("the gateway's prompts drifted from the sampled ids")


if __name__ == "__main__":
    main()
