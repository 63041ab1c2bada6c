"""Trajectory assembly: a rollout's LLM calls → token-exact training sequences.

Input: the rollout's calls in start order (prompt ids, output ids, engine logprobs, agent name, status):
``CallRecord``s, or the ``TokenCall``s the store's assembly read makes without them. Output: a
``Trajectory`` whose sequences carry ``token_ids``, ``loss_mask`` (1 exactly on sampled tokens),
``logprobs`` (the engine's on sampled tokens, None elsewhere), the weight versions that sampled them and
the rollout's reward.

Merge mode groups calls by agent name; within an agent a call extends whichever earlier branch its
prompt starts with (see ``assembly_tree``); otherwise it starts a new sequence. The usual rollout, one
agent whose every call continues the one before, takes a shortcut to the same result (``_single_run``).
Per-call mode makes one sequence per call choice. Calls that cannot be trained on-policy (retokenized, no
engine logprobs, no ids, error status, agent not selected) are left out and listed in
``Trajectory.excluded``; options bring retokenized and error calls back (flagged). ``check_invariants``
verifies the result.

The work is on token blobs (``assembly_calls``): prefixes compare as bytes, a sequence's ids are one
joined buffer, and the logprobs of its sampled tokens another. Sequences are built as packed numpy arrays
(ids of the blobs' type, int8 mask, float64 logprobs with NaN for None) that the routes serialize
directly; ``Sequence`` turns them into lists only when Python code reads them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from tracegym.gateway.assembly_calls import (
    DTYPES,
    TokenCall,
    TokenChoice,
    count,
    extends,
    payload,
    token_calls,
    values,
)
from tracegym.gateway.assembly_invariants import check_invariants
from tracegym.gateway.assembly_options import AssemblyOptions
from tracegym.gateway.assembly_rewards import discount_distances, discounted, step_rewards_by_call
from tracegym.gateway.assembly_tree import Chain, Node, chains, link, single_chains
from tracegym.gateway.store.codec import ITEMSIZE
from tracegym.types import CallRecord, Sequence, Trajectory

__all__ = ["AssemblyOptions", "TokenCall", "assemble", "assemble_rollout", "check_invariants",
           "exclusion_reason", "token_calls"]


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


def _collect(
    calls: list[TokenCall], options: AssemblyOptions
) -> tuple[dict[str | None, list[list[Node]]], list[dict[str, Any]]]:
    """Trained nodes grouped by agent (and by call within an agent), and the excluded choices."""
    groups: dict[str | None, list[list[Node]]] = {}
    excluded: list[dict[str, Any]] = []
    seen: set[str] = set()
    for pos, call in enumerate(calls):
        if call.call_id in seen:
            raise ValueError(f"duplicate call_id {call.call_id!r} in rollout {call.rollout_id!r}")
        seen.add(call.call_id)
        siblings: list[Node] = []
        prompt = call.prompt
        start = count(prompt)
        for choice in call.choices:
            reason = exclusion_reason(call, choice, options)
            if reason is not None:
                excluded.append({"call_id": call.call_id, "choice_index": choice.index, "reason": reason})
                continue
            out, lps = choice.output, choice.logprobs
            end = start + count(out)
            retok = call.retokenized or lps is None
            if lps is not None and count(lps) != end - start:
                raise ValueError(f"call {call.call_id} choice {choice.index}: {end - start} output ids but "
                                 f"{count(lps)} logprobs")
            node = Node(pos, call, choice, prompt, out, None if retok else lps,  # type: ignore[arg-type]
                        retok, start, end)
            siblings.append(node)
        if siblings:
            groups.setdefault(call.agent_name, []).append(siblings)
    return groups, excluded


def _single_run(calls: list[TokenCall], options: AssemblyOptions) -> Sequence | None:
    """Merge mode's result for the usual rollout, straight from its calls: one agent, trained, whose every
    call has one choice with ids and engine logprobs, status ok, and a prompt that continues the call
    before it. Then every call is a node whose parent is the call before it (the deepest earlier node its
    prompt continues, childless among equals), the tree is one path, and ``chains`` gives one chain of
    all calls: the same sequence without nodes or the tree search. None for any other rollout (the
    general path)."""
    if not calls or not options.trains_agent(calls[0].agent_name) or calls[0].prompt is None:
        return None
    agent, tag = calls[0].agent_name, calls[0].prompt[0]
    size = ITEMSIZE[tag]
    starts: list[int] = []
    ends: list[int] = []
    logprobs: list[bytes] = []
    call_ids: list[str] = []
    indices: list[int] = []
    prompt = output = b""
    for call in calls:
        if len(call.choices) != 1 or call.agent_name != agent or call.status != "ok" or call.retokenized:
            return None
        choice = call.choices[0]
        prev_prompt, prev_output = prompt, output
        prompt, output, lps = call.prompt, choice.output, choice.logprobs
        if prompt is None or output is None or lps is None or prompt[0] != tag or output[0] != tag:
            return None
        start = (len(prompt) - 1) // size
        end = start + (len(output) - 1) // size
        if count(lps) != end - start:
            return None  # the general path names the call
        if prev_prompt and not extends(prompt, prev_prompt, prev_output):
            return None
        starts.append(start)
        ends.append(end)
        logprobs.append(lps)
        call_ids.append(call.call_id)
        indices.append(choice.index)
    if len(set(call_ids)) != len(call_ids):
        return None  # the general path names the duplicate
    return Sequence(*_packed(prompt, output, starts, ends, logprobs), agent,
                    _versions((call, call.choices[0]) for call in calls), call_ids, indices, False)


def _versions(trained: Iterable[tuple[TokenCall, TokenChoice]]) -> list[str]:
    """The weight versions that sampled the trained outputs, in first-seen order (a choice's own, else its
    call's)."""
    versions: list[str] = []
    for call, choice in trained:
        for v in choice.versions or (call.weight_version,):
            if v is not None and v not in versions:
                versions.append(v)
    return versions


def _packed(prompt: bytes, output: bytes, starts: list[int], ends: list[int], logprobs: list[bytes | None]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sequence's packed token ids, int8 loss mask and float64 logprobs (NaN where none) from its last
    call's prompt and output blobs, the [start, end) of each trained output, and their logprob blobs (None:
    retokenized). The last prompt and output are the whole sequence (each trained call continues the one
    before it), joined into one buffer (a bytearray, so that the array is writable)."""
    token_ids = np.frombuffer(bytearray().join((payload(prompt), payload(output))), dtype=DTYPES[prompt[0]])
    n = len(token_ids)
    mask = bytearray(n)
    for start, end in zip(starts, ends, strict=True):
        if end > start:
            mask[start:end] = b"\x01" * (end - start)
    lps = np.empty(n)
    lps.fill(np.nan)
    tag = logprobs[0][0] if logprobs[0] is not None else None
    if all(b is not None and b[0] == tag for b in logprobs):
        # The sampled positions, in order, are the outputs one after another: one joined buffer of their
        # logprobs fills them all (no numpy call per output).
        joined = b"".join([b[1:] for b in logprobs])  # type: ignore[index]
        sampled = np.frombuffer(mask, dtype=np.bool_)
        lps[sampled] = np.frombuffer(joined, dtype=DTYPES[tag])  # type: ignore[index]
    else:
        for start, end, blob in zip(starts, ends, logprobs, strict=True):
            if blob is not None and end > start:
                lps[start:end] = values(blob)
    return token_ids, np.frombuffer(mask, dtype=np.int8), lps


def _sequence(chain: Chain) -> Sequence:
    """The sequence of a chain of nodes (each continues the one before it)."""
    nodes = chain.nodes
    last = nodes[-1]
    return Sequence(*_packed(last.prompt, last.output, [n.start for n in nodes], [n.end for n in nodes],
                             [n.logprobs for n in nodes]),
                    nodes[0].call.agent_name, _versions((n.call, n.choice) for n in nodes),
                    [n.call.call_id for n in nodes], [n.choice.index for n in nodes],
                    any(n.retokenized for n in nodes))


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
    run = _single_run(calls, opts) if opts.mode == "merge" else None
    excluded: list[dict[str, Any]] = []
    if run is not None:
        seqs, positions = [run], [range(len(calls))]
    else:
        groups, excluded = _collect(calls, opts)
        all_chains: list[Chain] = []
        for per_call in groups.values():
            all_chains += chains(link(per_call)) if opts.mode == "merge" else single_chains(
                [n for siblings in per_call for n in siblings])
        all_chains.sort(key=lambda c: (c.nodes[0].pos, c.nodes[0].choice.index))
        seqs = [_sequence(c) for c in all_chains]
        positions = [[n.pos for n in c.nodes] for c in all_chains]  # the calls each sequence trains

    for seq, dist in zip(seqs, discount_distances([p[-1] for p in positions]), strict=True):
        seq.reward = discounted(reward, opts.gamma, dist)
    step = step_rewards_by_call(calls, events)
    attached: set[int] = set()
    for seq, trained in zip(seqs, positions, strict=True) if step else ():
        for pos in trained:
            if pos in step and pos not in attached:
                seq.step_rewards += step[pos]
                attached.add(pos)
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
