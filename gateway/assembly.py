"""Trajectory assembly: a rollout's LLM calls → token-exact training sequences.

Input: the rollout's ``CallRecord``s in start order (prompt ids, output ids, engine logprobs, agent name,
status). Output: a ``Trajectory`` whose sequences carry ``token_ids``, ``loss_mask`` (1 exactly on sampled
tokens), ``logprobs`` (the engine's on sampled tokens, None elsewhere), the weight versions that sampled
them and the rollout's reward.

Merge mode groups calls by agent name; within an agent a call extends whichever earlier branch its
prompt starts with (see ``assembly_tree``); otherwise it starts a new sequence. Per-call mode makes one
sequence per call choice. Calls that cannot be trained on-policy (retokenized, no engine logprobs, no
ids, error status, agent not selected) are left out and listed in ``Trajectory.excluded``; options bring
retokenized and error calls back (flagged). ``check_invariants`` verifies the result.

Token ids may be lists or ``array.array``s (one kind per rollout): arrays compare as machine integers,
so a store that hands them out skips building an int object per prompt token. Sequences are built as
packed numpy arrays (ids, int8 mask, float64 logprobs with NaN for None) that the routes serialize
directly; ``Sequence`` turns them into lists only when Python code reads them.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any

import numpy as np

from tracegym.gateway.assembly_arrays import ids_array, logprobs_array
from tracegym.gateway.assembly_invariants import check_invariants
from tracegym.gateway.assembly_options import AssemblyOptions
from tracegym.gateway.assembly_rewards import discount_distances, discounted, step_rewards_by_call
from tracegym.gateway.assembly_tree import Chain, Node, chains, link, single_chains
from tracegym.types import CallRecord, ChoiceRecord, Sequence, Trajectory

__all__ = ["AssemblyOptions", "assemble", "assemble_rollout", "check_invariants", "exclusion_reason"]


def exclusion_reason(call: CallRecord, choice: ChoiceRecord, options: AssemblyOptions) -> str | None:
    """Why this call choice is not trained (None when it is)."""
    if not options.trains_agent(call.agent_name):
        return "agent"
    if call.prompt_ids is None or choice.output_ids is None:
        return "no_ids"
    if call.status == "error" and not options.include_errors:
        return "error"
    if (call.retokenized or choice.output_logprobs is None) and not options.include_retokenized:
        return "retokenized"
    return None


def _node(pos: int, call: CallRecord, prompt: list[int], choice: ChoiceRecord) -> Node:
    out = choice.output_ids if choice.output_ids is not None else prompt[:0]
    lps = choice.output_logprobs
    retok = call.retokenized or lps is None
    if lps is not None and len(lps) != len(out):
        raise ValueError(
            f"call {call.call_id} choice {choice.index}: {len(out)} output ids but {len(lps)} logprobs"
        )
    return Node(pos, call, choice, prompt, out, None if retok else lps, retok)


def _collect(
    calls: list[CallRecord], options: AssemblyOptions
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
        for choice in call.choices:
            reason = exclusion_reason(call, choice, options)
            if reason is None:
                siblings.append(_node(pos, call, call.prompt_ids, choice))  # type: ignore[arg-type]
            else:
                excluded.append({"call_id": call.call_id, "choice_index": choice.index, "reason": reason})
        if siblings:
            groups.setdefault(call.agent_name, []).append(siblings)
    return groups, excluded


def _linear_chain(per_call: list[list[Node]]) -> Chain | None:
    """The agent's calls as one chain when each has a single trained choice and continues the call before
    it with a longer prompt+output (the usual multi-turn agent), else None. Then the previous node is the
    unique deepest earlier node the prompt continues, so ``link`` would make it the parent, and ``chains``
    of that path is this one chain: the same result without the tree search."""
    nodes: list[Node] = []
    prev: Node | None = None
    for siblings in per_call:
        if len(siblings) != 1:
            return None
        node = siblings[0]
        if prev is not None and (node.end <= prev.end or not prev.continues(node.prompt)):
            return None
        nodes.append(node)
        prev = node
    return Chain(nodes)


def _versions(nodes: list[Node]) -> list[str]:
    """The weight versions that sampled the nodes' outputs, in first-seen order."""
    versions: list[str] = []
    for node in nodes:
        spans = node.choice.weight_versions
        for v in [w.version for w in spans] if spans else [node.call.weight_version]:
            if v is not None and v not in versions:
                versions.append(v)
    return versions


def _packed_logprobs(nodes: list[Node], end: int, mask: np.ndarray) -> np.ndarray:
    """float64 logprobs aligned to the sequence, NaN where none (context, retokenized output)."""
    logprobs = np.full(end, np.nan)
    lps = [n.logprobs for n in nodes]
    types = {type(a) is array and a.typecode for a in lps}
    if len(types) == 1 and types.pop():
        # The store's case: the sampled positions, in order, are the nodes' outputs one after another, so
        # one joined buffer fills them all (no numpy call per node).
        logprobs[mask.view(np.bool_)] = np.frombuffer(b"".join(lps), dtype=lps[0].typecode)
        return logprobs
    for node in nodes:
        if not node.retokenized and node.end > len(node.prompt):
            logprobs[len(node.prompt) : node.end] = logprobs_array(node.logprobs)
    return logprobs


def _sequence(chain: Chain) -> Sequence:
    nodes = chain.nodes
    first, last = nodes[0], nodes[-1]
    # Every node continues the one before it (its parent), so the concatenated prompt suffixes and
    # outputs are exactly the last node's prompt + output; sampled spans are [len(prompt), end).
    # Packed arrays (see ``Sequence``): no Python object per token; retokenized spans keep NaN (None).
    # Ids of the store's arrays: one joined buffer (a bytearray, so the array is writable as concatenate's is).
    if type(last.prompt) is array and type(last.output) is array and last.prompt.typecode == last.output.typecode:
        token_ids = np.frombuffer(bytearray().join((last.prompt, last.output)), dtype=last.prompt.typecode)
    else:
        token_ids = np.concatenate((ids_array(last.prompt), ids_array(last.output)))
    mask = bytearray(last.end)
    for node in nodes:
        start = len(node.prompt)
        if node.end > start:
            mask[start : node.end] = b"\x01" * (node.end - start)
    loss_mask = np.frombuffer(mask, dtype=np.int8)
    return Sequence(
        token_ids,
        loss_mask,
        _packed_logprobs(nodes, last.end, loss_mask),
        first.call.agent_name,
        _versions(nodes),
        [n.call.call_id for n in nodes],
        [n.choice.index for n in nodes],
        any(n.retokenized for n in nodes),
    )


def assemble(
    calls: list[CallRecord],
    *,
    rollout_id: str,
    task_id: str | None = None,
    reward: float | None = None,
    events: Iterable[dict[str, Any]] = (),
    options: AssemblyOptions | None = None,
    group_id: str | None = None,
    status: str | None = None,
) -> Trajectory:
    """Assemble one rollout. ``calls`` in start order; ``events`` are its reward events
    (``value``, ``name``, ``call_index`` or ``created_at``)."""
    opts = options or AssemblyOptions()
    groups, excluded = _collect(calls, opts)
    all_chains: list[Chain] = []
    for per_call in groups.values():
        if opts.mode == "merge":
            linear = _linear_chain(per_call)
            all_chains += [linear] if linear is not None else chains(link(per_call))
        else:
            all_chains += single_chains([n for siblings in per_call for n in siblings])
    all_chains.sort(key=lambda c: (c.nodes[0].pos, c.nodes[0].choice.index))
    seqs = [_sequence(c) for c in all_chains]

    ends = [c.nodes[-1].pos for c in all_chains]
    for seq, dist in zip(seqs, discount_distances(ends), strict=True):
        seq.reward = discounted(reward, opts.gamma, dist)
    step = step_rewards_by_call(calls, events)
    attached: set[int] = set()
    for seq, chain in zip(seqs, all_chains, strict=True) if step else ():
        for node in chain.nodes:
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
    calls: list[CallRecord],
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
