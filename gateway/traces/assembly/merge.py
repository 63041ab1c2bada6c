"""``assemble``: a rollout's LLM calls → token-exact training sequences (``Trajectory``).

Merge mode groups calls by agent and links each trained call choice into that agent's prefix tree
(``tree``); every leaf's chain is one sequence. Per-call mode makes one sequence per call choice. Choices
that cannot be trained on-policy are listed in ``Trajectory.excluded`` with the reason. Sequences are built
from the calls' blobs as numpy arrays of ``tracegym.arrays``' types (ids of the blobs' width, int32 or int64;
int8 mask; float64 logprobs with NaN for None), which the routes serialize directly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from tracegym.arrays import LOGPROB_DTYPE, LOSS_MASK_DTYPE, TokenArrays
from tracegym.gateway.traces.assembly.options import AssemblyOptions
from tracegym.gateway.traces.assembly.rewards import discount_distances, discounted, step_rewards_by_call
from tracegym.gateway.traces.assembly.tree import Node, chains, link
from tracegym.gateway.traces.codec import DTYPES, ITEMSIZE
from tracegym.gateway.traces.token_calls import (
    TokenCall,
    TokenChoice,
    count,
    payload,
    token_calls,
    values,
)
from tracegym.types import CallRecord, Sequence, Trajectory

_D = ord("d")


def exclusion_reason(call: TokenCall, choice: TokenChoice, options: AssemblyOptions) -> str | None:
    """Why this call choice is not trained (None when it is)."""
    if not options.trains_agent(call.agent_name):
        return "agent"
    if call.prompt is None or choice.output is None:
        return "no_ids"
    if call.status == "error" and not options.include_errors:
        return "error"
    if (call.retokenized or choice.logprobs is None) and not options.include_retokenized:
        return "retokenized"
    return None


def _chains(calls: list[TokenCall], options: AssemblyOptions
            ) -> tuple[list[list[Node]], list[dict[str, Any]]]:
    """The chain of nodes of every sequence, in any order, and the excluded choices."""
    if len({call.call_id for call in calls}) != len(calls):
        dup = next(c for i, c in enumerate(calls) if any(d.call_id == c.call_id for d in calls[:i]))
        raise ValueError(f"duplicate call_id {dup.call_id!r} in rollout {dup.rollout_id!r}")
    nodes: dict[str | None, list[Node]] = {}  # per agent, its trained choices in creation order
    excluded: list[dict[str, Any]] = []
    for pos, call in enumerate(calls):
        prompt = call.prompt
        start = count(prompt)
        for choice in call.choices:
            reason = exclusion_reason(call, choice, options)
            if reason is not None:
                excluded.append({"call_id": call.call_id, "choice_index": choice.index, "reason": reason})
                continue
            out, lps = choice.output, choice.logprobs
            end = start + (len(out) - 1) // ITEMSIZE[out[0]]  # count(out), inline: once per span
            if lps is not None and (len(lps) - 1) // ITEMSIZE[lps[0]] != end - start:
                raise ValueError(f"call {call.call_id} choice {choice.index}: {end - start} output ids but "
                                 f"{count(lps)} logprobs")
            node = Node(pos, call, choice, prompt, out,  # type: ignore[arg-type]
                        None if call.retokenized else lps, start, end)
            nodes.setdefault(call.agent_name, []).append(node)
    found: list[list[Node]] = []
    for per_agent in nodes.values():
        found += chains(link(per_agent)) if options.mode == "merge" else [[node] for node in per_agent]
    return found, excluded


def _versions(chain: list[Node]) -> list[str]:
    """The weight versions that sampled the trained outputs, in first-seen order (a choice's own, else its
    call's)."""
    versions: list[str] = []
    for node in chain:
        for v in node.choice.versions or (node.call.weight_version,):
            if v is not None and v not in versions:
                versions.append(v)
    return versions


def _sequence(chain: list[Node]) -> Sequence:
    """The sequence of a chain (each node continues the one before it): the last node's prompt and output
    are all its ids, joined into one buffer (a bytearray, so that the arrays are writable); mask 1 on every
    node's output; the engine's logprobs there, NaN elsewhere. The sampled positions in order are the
    outputs one after another, so one joined buffer of the outputs' logprobs fills them all."""
    last = chain[-1]
    token_ids = np.frombuffer(bytearray().join((payload(last.prompt), payload(last.output))),
                              dtype=DTYPES[last.prompt[0]])
    n = len(token_ids)
    mask = bytearray(n)
    for node in chain:
        mask[node.start : node.end] = b"\x01" * (node.end - node.start)
    tags = {node.logprobs[0] for node in chain if node.logprobs is not None}
    tag = tags.pop() if len(tags) == 1 else _D  # float64 when the chain mixes types (or has none)
    joined = b"".join([payload(node.logprobs) if node.logprobs is not None and node.logprobs[0] == tag
                       else _logprob_values(node, tag) for node in chain])
    logprobs = np.empty(n, LOGPROB_DTYPE)
    logprobs.fill(np.nan)
    logprobs[np.frombuffer(mask, dtype=np.bool_)] = np.frombuffer(joined, dtype=DTYPES[tag])
    arrays = TokenArrays(token_ids, np.frombuffer(mask, dtype=LOSS_MASK_DTYPE), logprobs)  # in its types
    return Sequence.from_arrays(arrays, last.call.agent_name, _versions(chain),
                                [node.call.call_id for node in chain], [node.choice.index for node in chain],
                                any(node.logprobs is None for node in chain))


def _logprob_values(node: Node, tag: int) -> bytes:
    """The node's logprobs as values of the float type ``tag``: NaN when it has none."""
    if node.logprobs is None:
        return np.full(node.end - node.start, np.nan, dtype=DTYPES[tag]).tobytes()
    return values(node.logprobs).astype(DTYPES[tag]).tobytes()


def assemble(
    calls: list[CallRecord] | list[TokenCall],
    *,
    rollout_id: str,
    task_id: str | None = None,
    reward: float | None = None,
    events: Iterable[dict[str, Any]] = (),
    options: AssemblyOptions | None = None,
    group_id: str | None = None,
    status: str | None = None,
) -> Trajectory:
    """Assemble one rollout. ``calls`` in start order (``CallRecord``s, or the store's ``TokenCall``s);
    ``events`` are its reward events (``value``, ``name``, ``call_index`` or ``created_at``)."""
    opts = options or AssemblyOptions()
    calls = token_calls(calls)
    found, excluded = _chains(calls, opts)
    if len(found) > 1:
        found.sort(key=lambda c: (c[0].pos, c[0].choice.index))
    seqs = [_sequence(c) for c in found]
    for seq, dist in zip(seqs, discount_distances([c[-1].pos for c in found]), strict=True):
        seq.reward = discounted(reward, opts.gamma, dist)
    step = step_rewards_by_call(calls, events)
    attached: set[int] = set()
    for seq, chain in zip(seqs, found, strict=True) if step else ():
        for node in chain:
            if node.pos in step and node.pos not in attached:
                seq.step_rewards += step[node.pos]
                attached.add(node.pos)
    return Trajectory(
        rollout_id=rollout_id,
        task_id=task_id,
        reward=reward,
        sequences=seqs,
        group_id=group_id,
        status=status,
        excluded=excluded,
    )


def assemble_rollout(
    rollout: dict[str, Any],
    calls: list[CallRecord] | list[TokenCall],
    reward_events: Iterable[dict[str, Any]] = (),
    options: AssemblyOptions | None = None,
) -> Trajectory:
    """Assemble from a Rollout row (``docs/api.md``: ``rollout_id``, ``task_id``, ``group_id``,
    ``status``, ``reward``) as the store returns it."""
    return assemble(
        calls,
        rollout_id=rollout["rollout_id"],
        task_id=rollout.get("task_id"),
        reward=rollout.get("reward"),
        events=reward_events,
        options=options,
        group_id=rollout.get("group_id"),
        status=rollout.get("status"),
    )
