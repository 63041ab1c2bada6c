"""Property-based assembly tests over synthetic rollouts: extensions, rewrites, retries, parallel agents,
n>1 choices, retokenized/error/id-less calls. The assembly equals a brute-force model of its rules, the
invariants always hold, merges are maximal, and ``check_invariants`` catches any corruption."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tracegym.gateway.traces.assembly import (
    AssemblyOptions,
    InvariantError,
    assemble,
    check_invariants,
    exclusion_reason,
)
from tracegym.gateway.traces.token_calls import token_calls
from tracegym.types import CallRecord, ChoiceRecord, Sequence, Trajectory, WeightVersionSpan

AGENTS = ["a", "b", None]
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _record(i: int, prompt: list[int] | None, outputs: list[list[int] | None], **kw: Any) -> CallRecord:
    choices = [
        ChoiceRecord(
            index=k,
            output_ids=out,
            output_logprobs=None if out is None or kw.get("no_logprobs") else [-(t % 97) / 10 for t in out],
            finish_reason="stop",
            message=None,
        )
        for k, out in enumerate(outputs)
    ]
    return CallRecord(
        call_id=f"c{i}",
        rollout_id="r",
        operation="chat",
        model="m",
        upstream_kind="sglang",
        request={},
        choices=choices,
        prompt_ids=prompt,
        agent_name=kw.get("agent"),
        weight_version=f"v{i // 3}",
        retokenized=kw.get("retokenized", False),
        start_time_ns=i * 10,
        status=kw.get("status", "ok"),
    )


@st.composite
def rollouts(draw: st.DrawFn, unique: bool = False, flags: bool = True) -> list[CallRecord]:
    """Calls of one rollout. ``unique``: every output token id is new and outputs are non-empty (no
    coincidental prefixes); else ids come from a tiny vocabulary, so accidental matches happen."""
    fresh = itertools.count(1000)
    small = st.lists(st.integers(0, 9), max_size=3)
    fulls: list[list[int]] = []
    prompts: list[list[int]] = []
    calls: list[CallRecord] = []
    for i in range(draw(st.integers(1, 9))):
        kind = draw(st.sampled_from(["fresh", "extend", "extend", "extend", "rewrite", "near", "retry"]))
        if kind == "extend" and fulls:
            prompt = draw(st.sampled_from(fulls)) + draw(small)
        elif kind == "rewrite" and fulls:
            base = draw(st.sampled_from(fulls))
            cut = draw(st.integers(0, len(base)))
            prompt = [*base[:cut], draw(st.integers(10, 19)), *draw(small)]
        elif kind == "near" and fulls:  # an earlier conversation with one token changed
            prompt = list(draw(st.sampled_from(fulls))) + draw(small)
            if prompt:
                j = draw(st.integers(0, len(prompt) - 1))
                prompt[j] = 20 + prompt[j] % 7
        elif kind == "retry" and prompts:
            prompt = list(draw(st.sampled_from(prompts)))
        else:
            prompt = draw(small)
        outputs: list[list[int] | None] = []
        for _ in range(draw(st.integers(1, 3))):
            if unique:
                outputs.append([next(fresh) for _ in range(draw(st.integers(1, 3)))])
            else:
                outputs.append(draw(st.lists(st.integers(0, 12), max_size=3)))
        kw: dict[str, Any] = {"agent": draw(st.sampled_from(AGENTS))}
        if flags:
            kw["retokenized"] = draw(st.sampled_from([False, False, False, True]))
            kw["status"] = draw(st.sampled_from(["ok", "ok", "ok", "error"]))
            kw["no_logprobs"] = draw(st.sampled_from([False] * 5 + [True]))
            if draw(st.sampled_from([False] * 7 + [True])):
                outputs[0] = None
        calls.append(_record(i, prompt, outputs, **kw))
        prompts.append(prompt)
        fulls += [prompt + out for out in outputs if out is not None]
    return calls


options = st.builds(
    AssemblyOptions,
    mode=st.sampled_from(["merge", "per_call"]),
    agent_match=st.sampled_from([None, "a", "^$", ("b",), ("a", "b")]),
    include_retokenized=st.booleans(),
    include_errors=st.booleans(),
    gamma=st.sampled_from([1.0, 0.9]),
)


def _choice(calls: list[CallRecord], call_id: str, k: int) -> tuple[CallRecord, ChoiceRecord]:
    call = next(c for c in calls if c.call_id == call_id)
    return call, next(ch for ch in call.choices if ch.index == k)


@SETTINGS
@given(rollouts(), options)
def test_invariants_hold_and_sampled_tokens_are_the_concatenated_outputs(calls, opts):
    traj = assemble(calls, rollout_id="r", reward=1.0, options=opts)
    check_invariants(calls, traj)
    for seq in traj.sequences:
        pairs = [_choice(calls, c, k) for c, k in zip(seq.call_ids, seq.choice_indices, strict=True)]
        assert [t for t, m in zip(seq.token_ids, seq.loss_mask, strict=True) if m] == [
            t for _, ch in pairs for t in ch.output_ids
        ]
        assert len({c.agent_name for c, _ in pairs}) == 1
        assert seq.retokenized == any(c.retokenized or ch.output_logprobs is None for c, ch in pairs)
        assert 0 < seq.reward <= 1.0
    trained = sum(len(s.call_ids) for s in traj.sequences)
    assert trained + len(traj.excluded) == sum(len(c.choices) for c in calls)


@SETTINGS
@given(rollouts(unique=True))
def test_merge_is_maximal_one_sequence_per_branch_end(calls):
    """A trained choice ends a sequence exactly when no later call of its agent continues it."""
    opts = AssemblyOptions()
    traj = assemble(calls, rollout_id="r", options=opts)
    check_invariants(calls, traj)
    trained = [
        (i, c, ch)
        for i, (c, tc) in enumerate(zip(calls, token_calls(calls), strict=True))
        for ch, tch in zip(c.choices, tc.choices, strict=True)
        if not exclusion_reason(tc, tch, opts)
    ]

    def continued(i: int, c: CallRecord, ch: ChoiceRecord) -> bool:
        full = c.prompt_ids + ch.output_ids
        return any(
            j > i and d.agent_name == c.agent_name and d.prompt_ids[: len(full)] == full
            for j, d, _ in trained
        )

    ends = [(c.call_id, ch.index) for i, c, ch in trained if not continued(i, c, ch)]
    assert sorted((s.call_ids[-1], s.choice_indices[-1]) for s in traj.sequences) == sorted(ends)


@SETTINGS
@given(rollouts(), options)
def test_per_call_mode_makes_one_sequence_per_trained_choice(calls, opts):
    opts = AssemblyOptions(mode="per_call", include_retokenized=opts.include_retokenized)
    traj = assemble(calls, rollout_id="r", options=opts)
    check_invariants(calls, traj)
    assert all(len(s.call_ids) == 1 for s in traj.sequences)
    assert len(traj.sequences) == sum(
        1 for c in token_calls(calls) for ch in c.choices if exclusion_reason(c, ch, opts) is None
    )


@st.composite
def mostly_linear(draw: st.DrawFn) -> list[CallRecord]:
    """Agent runs that usually extend their last call (the usual rollout), sometimes branch, retry, sample
    n > 1, add empty outputs, switch agent, record per-choice weight versions, or make a call that is not
    trained by default (retokenized, no logprobs, error)."""
    calls: list[CallRecord] = []
    last: dict[str | None, list[int]] = {}
    previous: dict[str | None, tuple[list[int], list[int]]] = {}  # the agent's last prompt and output
    for i in range(draw(st.integers(1, 8))):
        agent = draw(st.sampled_from(["a"] * 9 + ["b"]))
        flag = draw(st.sampled_from([None] * 12 + ["retokenized", "no_logprobs", "status"]))
        flags: dict[str, Any] = {} if flag is None else {flag: "error" if flag == "status" else True}
        head = last.get(agent, [])
        kind = draw(st.sampled_from(["extend"] * 6 + ["retry", "cut", "n2", "empty", "resample", "resample"]))
        new = draw(st.lists(st.integers(0, 5), max_size=3))
        if kind == "cut" and head:
            head = head[: draw(st.integers(0, len(head) - 1))]
        prompt = head + new if kind != "retry" else head
        outs = [draw(st.lists(st.integers(0, 5), min_size=0 if kind == "empty" else 1, max_size=3))
                for _ in range(2 if kind == "n2" else 1)]
        if kind == "resample" and agent in previous:  # the last prompt again: the same output, a part, or new
            prompt, out = previous[agent]
            outs = [draw(st.sampled_from([out, out, out[: len(out) // 2], outs[0]]))]
        previous[agent] = (prompt, outs[0])
        call = _record(i, prompt, outs, agent=agent, **flags)
        if draw(st.sampled_from([False] * 5 + [True])):
            spans = [WeightVersionSpan(f"w{i % 2}", 0, 1), WeightVersionSpan("v0", 1, 2)]
            call.choices[0].weight_versions = spans
        calls.append(call)
        last[agent] = prompt + outs[0]
    return calls


def _model(calls: list[CallRecord], opts: AssemblyOptions, reward: float) -> Trajectory:
    """What ``assemble`` promises, computed the slow, obvious way on lists, straight from the rules:

    - a choice is trained unless its agent is not selected, it has no ids, its call ended in error, or
      it was retokenized or has no engine logprobs (the last two unless the options bring them back);
    - merge mode: a trained choice's parent is, among the trained choices of earlier calls of its agent
      whose prompt + output is a prefix of its prompt, the longest; on equal length one without children
      at that moment, then the earliest. Per-call mode: no parents;
    - every leaf is a sequence: the leaf and its ancestors up to the first one whose heir it is not (the
      heir: the child with the most descendants, the earliest on ties); sequences in order of their first
      call and choice;
    - a sequence is its last choice's prompt + output, mask 1 and the engine's logprobs (None for a
      retokenized call) on each choice's output, the rollout reward times gamma to the number of distinct
      later end calls."""
    excluded: list[dict[str, Any]] = []
    nodes: list[tuple[int, CallRecord, ChoiceRecord]] = []
    for pos, c in enumerate(calls):
        for ch in c.choices:
            reason = None
            if not opts.trains_agent(c.agent_name):
                reason = "agent"
            elif c.prompt_ids is None or ch.output_ids is None:
                reason = "no_ids"
            elif c.status == "error" and not opts.include_errors:
                reason = "error"
            elif (c.retokenized or ch.output_logprobs is None) and not opts.include_retokenized:
                reason = "retokenized"
            if reason:
                excluded.append({"call_id": c.call_id, "choice_index": ch.index, "reason": reason})
            else:
                nodes.append((pos, c, ch))

    def full(u: int) -> list[int]:
        return list(nodes[u][1].prompt_ids) + list(nodes[u][2].output_ids)

    parent: list[int | None] = []
    for pos, c, _ in nodes:
        earlier = [u for u in range(len(parent)) if nodes[u][0] < pos]
        candidates = [
            u for u in earlier
            if nodes[u][1].agent_name == c.agent_name and list(c.prompt_ids)[: len(full(u))] == full(u)
        ]
        if opts.mode != "merge" or not candidates:
            parent.append(None)
            continue
        has_children = {parent[w] for w in earlier}  # as linked so far (a call's choices are linked together)
        parent.append(max(candidates, key=lambda u: (len(full(u)), u not in has_children, -u)))

    def children(u: int) -> list[int]:
        return [w for w, p in enumerate(parent) if p == u]

    def size(u: int) -> int:
        return 1 + sum(size(w) for w in children(u))

    def heir(u: int) -> int:
        return max(children(u), key=lambda w: (size(w), -w))

    chains = []
    for leaf in range(len(nodes)):
        if children(leaf):
            continue
        path = [leaf]
        while parent[path[-1]] is not None and heir(parent[path[-1]]) == path[-1]:
            path.append(parent[path[-1]])
        chains.append(path[::-1])
    chains.sort(key=lambda path: (nodes[path[0]][0], nodes[path[0]][2].index))
    ends = [nodes[path[-1]][0] for path in chains]
    seqs = []
    for path, end in zip(chains, ends, strict=True):
        ids = full(path[-1])
        mask, lps = [0] * len(ids), [None] * len(ids)
        versions: list[str] = []
        for u in path:
            _, c, ch = nodes[u]
            for j, t in enumerate(ch.output_ids):
                at = len(c.prompt_ids) + j
                assert ids[at] == t
                mask[at] = 1
                lps[at] = None if c.retokenized or ch.output_logprobs is None else ch.output_logprobs[j]
            for v in [w.version for w in ch.weight_versions] or [c.weight_version]:
                if v is not None and v not in versions:
                    versions.append(v)
        seqs.append(Sequence(
            ids, mask, lps, nodes[path[0]][1].agent_name, versions,
            [nodes[u][1].call_id for u in path], [nodes[u][2].index for u in path],
            any(nodes[u][1].retokenized or nodes[u][2].output_logprobs is None for u in path),
            reward * opts.gamma ** len({e for e in ends if e > end}),
        ))
    return Trajectory("r", None, reward, seqs, excluded=excluded)


TIES = [
    # the same prompt sampled twice with the same output, then continued: the earlier one is the parent
    [_record(0, [1], [[10]]), _record(1, [1], [[10]]), _record(2, [1, 10, 2], [[11]])],
    # a longer earlier output, then a shorter resample the next call also continues: the deeper wins
    [_record(0, [1], [[10, 11]]), _record(1, [1], [[10]]), _record(2, [1, 10, 11, 2], [[12]])],
    # an empty output (as deep as its parent): of the two, the childless one is continued
    [_record(0, [1], [[10]]), _record(1, [1, 10], [[]]), _record(2, [1, 10, 3], [[13]])],
    # two branches from one call, the later one longer: it carries the shared call
    [_record(0, [1], [[10]]), _record(1, [1, 10, 2], [[20]]), _record(2, [1, 10, 3], [[30]]),
     _record(3, [1, 10, 3, 30, 4], [[40]])],
]


@SETTINGS
@given(st.one_of(mostly_linear(), rollouts()), options)
@example(TIES[0], AssemblyOptions())
@example(TIES[1], AssemblyOptions())
@example(TIES[2], AssemblyOptions())
@example(TIES[3], AssemblyOptions(gamma=0.9))
def test_assembly_equals_a_brute_force_model(calls, opts):
    """The prefix tree's linking, heirs and sequence building agree with ``_model``'s direct reading of the
    rules, on rollouts that are mostly linear (the case the linking checks first) and on ones that branch,
    rewrite and retry with a tiny vocabulary (accidental prefixes, ties of depth and of subtree size)."""
    traj = assemble(calls, rollout_id="r", reward=1.0, options=opts)
    assert traj == _model(calls, opts, 1.0)
    check_invariants(calls, traj)


@SETTINGS
@given(
    st.lists(st.tuples(st.lists(st.integers(0, 50), max_size=4), st.lists(st.integers(0, 50))), min_size=1)
)
def test_a_linear_conversation_is_one_sequence(turns):
    """Each call's prompt = the previous prompt + reply + new (tool/user) tokens: one merged sequence."""
    calls, prompt = [], [7]
    for i, (new_tokens, out) in enumerate(turns):
        prompt = prompt + new_tokens
        calls.append(_record(i, prompt, [out]))
        prompt = prompt + out
    traj = assemble(calls, rollout_id="r")
    check_invariants(calls, traj)
    (seq,) = traj.sequences
    assert seq.token_ids == prompt
    assert [t for t, m in zip(seq.token_ids, seq.loss_mask, strict=True) if m] == [
        t for _, o in turns for t in o
    ]


@SETTINGS
@given(rollouts(flags=False), st.data())
def test_check_invariants_catches_any_corruption(calls, data):
    traj = assemble(calls, rollout_id="r")
    seqs = [s for s in traj.sequences if s.token_ids]
    if not seqs:
        return
    seq = data.draw(st.sampled_from(seqs))
    i = data.draw(st.integers(0, len(seq.token_ids) - 1))
    what = data.draw(st.sampled_from(["mask", "token", "logprob"]))
    if what == "mask":
        seq.loss_mask[i] = 1 - seq.loss_mask[i]
    elif what == "token":
        seq.token_ids[i] += 1
    else:
        seq.logprobs[i] = None if seq.loss_mask[i] else -0.25
    try:
        check_invariants(calls, traj)
    except InvariantError:
        return
    raise AssertionError(f"corrupting {what} at {i} went unnoticed")


def _as_arrays(calls: list[CallRecord]) -> list[CallRecord]:
    out = []
    for c in calls:
        choices = [
            ChoiceRecord(
                ch.index,
                None if ch.output_ids is None else np.array(ch.output_ids, dtype=np.int32),
                None if ch.output_logprobs is None else np.array(ch.output_logprobs, dtype=np.float64),
                ch.finish_reason,
                ch.message,
            )
            for ch in c.choices
        ]
        prompt = None if c.prompt_ids is None else np.array(c.prompt_ids, dtype=np.int32)
        out.append(replace(c, prompt_ids=prompt, choices=choices))
    return out


@SETTINGS
@given(rollouts(), options)
def test_array_token_ids_assemble_exactly_like_lists(calls, opts):
    as_lists = assemble(calls, rollout_id="r", reward=1.0, options=opts)
    arrays = _as_arrays(calls)
    as_arrays = assemble(arrays, rollout_id="r", reward=1.0, options=opts)
    check_invariants(arrays, as_arrays)
    assert as_arrays == as_lists
    assert all(type(s.token_ids) is list for s in as_arrays.sequences)


@SETTINGS
@given(rollouts(flags=False), st.data())
def test_check_invariants_catches_any_corruption_of_array_records(calls, data):
    """The same corruptions, on records with numpy int32 ids and float32 logprobs (stored as ``i`` and ``f``
    blobs): the slice-wise check compares packed machine integers there."""
    arrays = _as_arrays(calls)
    for c in arrays:
        for ch in c.choices:
            if ch.output_logprobs is not None:
                ch.output_logprobs = np.array(ch.output_logprobs, dtype=np.float32)
    traj = assemble(arrays, rollout_id="r")
    check_invariants(arrays, traj)
    seqs = [s for s in traj.sequences if s.token_ids]
    if not seqs:
        return
    seq = data.draw(st.sampled_from(seqs))
    i = data.draw(st.integers(0, len(seq.token_ids) - 1))
    what = data.draw(st.sampled_from(["mask", "token", "logprob", "big"]))
    if what == "mask":
        seq.loss_mask[i] = 1 - seq.loss_mask[i]
    elif what == "token":
        seq.token_ids[i] += 1
    elif what == "big":
        seq.token_ids[i] += 2**32  # the same id modulo 2**32: must not pass as int32
    else:
        seq.logprobs[i] = None if seq.loss_mask[i] else -0.25
    try:
        check_invariants(arrays, traj)
    except InvariantError:
        return
    raise AssertionError(f"corrupting {what} at {i} went unnoticed")
