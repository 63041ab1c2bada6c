"""Trajectory assembly on hand-written rollouts: merges, forks, parallel agents, n>1, flags, rewards."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import orjson
import pytest

from tracegym.gateway.api.trajectories import trajectory_json
from tracegym.gateway.traces.assembly import (
    AssemblyOptions,
    InvariantError,
    assemble,
    assemble_rollout,
    check_invariants,
)
from tracegym.gateway.traces.assembly.rewards import time_ns
from tracegym.gateway.traces.token_calls import token_calls
from tracegym.types import CallRecord, ChoiceRecord, Sequence, Trajectory, WeightVersionSpan


def call(
    cid: str,
    prompt: list[int] | None,
    *outputs: list[int] | None,
    agent: str | None = None,
    t: int = 0,
    retokenized: bool = False,
    status: str = "ok",
    version: str | None = "v0",
) -> CallRecord:
    choices = [
        ChoiceRecord(
            index=i,
            output_ids=out,
            output_logprobs=None if out is None or retokenized else [-0.5 - tok / 1000 for tok in out],
            finish_reason="stop",
            message=None,
        )
        for i, out in enumerate(outputs)
    ]
    return CallRecord(
        call_id=cid,
        rollout_id="r1",
        operation="chat",
        model="m",
        upstream_kind="sglang",
        request={},
        choices=choices,
        prompt_ids=prompt,
        agent_name=agent,
        weight_version=version,
        retokenized=retokenized,
        start_time_ns=t,
        status=status,  # type: ignore[arg-type]
    )


def run(calls: list[CallRecord], **kw) -> Trajectory:
    opts = AssemblyOptions(**kw.pop("options", {}))
    traj = assemble(calls, rollout_id="r1", options=opts, **kw)
    check_invariants(calls, traj)
    return traj


def sampled(seq) -> list[int]:
    return [t for t, m in zip(seq.token_ids, seq.loss_mask, strict=True) if m]


def test_multi_turn_merges_into_one_sequence_with_tool_tokens_masked():
    c1 = call("c1", [1, 2, 3], [10, 11])
    c2 = call("c2", [1, 2, 3, 10, 11, 50, 51], [12])  # tool result 50, 51
    c3 = call("c3", [1, 2, 3, 10, 11, 50, 51, 12, 60], [13, 14])
    traj = run([c1, c2, c3], reward=1.0)
    assert len(traj.sequences) == 1
    seq = traj.sequences[0]
    assert seq.token_ids == [1, 2, 3, 10, 11, 50, 51, 12, 60, 13, 14]
    assert seq.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert seq.logprobs[3] == pytest.approx(-0.51) and seq.logprobs[0] is None and seq.logprobs[5] is None
    assert seq.call_ids == ["c1", "c2", "c3"] and seq.reward == 1.0 and seq.weight_versions == ["v0"]


def test_rewritten_context_starts_a_new_sequence():
    c1 = call("c1", [1, 2], [10])
    c2 = call("c2", [1, 99, 10, 5], [11])  # the agent rewrote its history
    traj = run([c1, c2])
    assert [s.call_ids for s in traj.sequences] == [["c1"], ["c2"]]
    assert traj.sequences[1].loss_mask == [0, 0, 0, 0, 1]


def test_call_extends_an_earlier_branch_not_only_the_last():
    c1 = call("c1", [1], [10])
    c2 = call("c2", [7], [20])  # an unrelated sub-conversation of the same agent
    c3 = call("c3", [1, 10, 2], [11])  # continues c1, not c2
    c4 = call("c4", [7, 20, 3], [21])  # continues c2
    traj = run([c1, c2, c3, c4])
    assert [s.call_ids for s in traj.sequences] == [["c1", "c3"], ["c2", "c4"]]


def test_parallel_calls_from_one_context():
    base = call("c1", [1], [10])
    a = call("a", [1, 10, 2], [11])
    b = call("b", [1, 10, 3], [12])
    a2 = call("a2", [1, 10, 2, 11, 4], [13])
    traj = run([base, a, b, a2])
    # the longer branch carries the shared history; the other keeps it as context
    assert [s.call_ids for s in traj.sequences] == [["c1", "a", "a2"], ["b"]]
    assert traj.sequences[1].token_ids == [1, 10, 3, 12] and traj.sequences[1].loss_mask == [0, 0, 0, 1]


def test_n_greater_than_one_each_choice_is_a_branch_and_the_continued_one_keeps_history():
    c1 = call("c1", [1], [10])
    c2 = call("c2", [1, 10, 2], [20], [21], [22])
    c3 = call("c3", [1, 10, 2, 21, 3], [30])  # continues choice 1
    traj = run([c1, c2, c3])
    by_calls = {tuple(zip(s.call_ids, s.choice_indices, strict=True)): s for s in traj.sequences}
    assert set(by_calls) == {(("c2", 0),), (("c1", 0), ("c2", 1), ("c3", 0)), (("c2", 2),)}
    main = by_calls[(("c1", 0), ("c2", 1), ("c3", 0))]
    assert sampled(main) == [10, 21, 30]
    assert by_calls[(("c2", 0),)].token_ids == [1, 10, 2, 20]
    assert by_calls[(("c2", 0),)].loss_mask == [0, 0, 0, 1]


def test_agents_are_grouped_and_selected():
    calls = [
        call("p1", [1], [10], agent="planner"),
        call("w1", [1, 10, 5], [20], agent="worker"),  # extends the planner's text but is another agent
        call("p2", [1, 10, 6], [11], agent="planner"),
    ]
    traj = run(calls)
    assert [(s.agent_name, s.call_ids) for s in traj.sequences] == [
        ("planner", ["p1", "p2"]),
        ("worker", ["w1"]),
    ]
    only = run(calls, options={"agent_match": "^plan"})
    assert [s.call_ids for s in only.sequences] == [["p1", "p2"]]
    assert only.excluded == [{"call_id": "w1", "choice_index": 0, "reason": "agent"}]
    listed = run(calls, options={"agent_match": ["worker"]})
    assert [s.call_ids for s in listed.sequences] == [["w1"]]


def test_per_call_mode():
    c1 = call("c1", [1, 2], [10])
    c2 = call("c2", [1, 2, 10, 3], [11], [12])
    traj = run([c1, c2], options={"mode": "per_call"})
    assert [(s.call_ids, s.choice_indices) for s in traj.sequences] == [
        (["c1"], [0]),
        (["c2"], [0]),
        (["c2"], [1]),
    ]
    assert traj.sequences[1].loss_mask == [0, 0, 0, 0, 1]


def test_retokenized_calls_are_excluded_by_default_and_flagged_when_included():
    c1 = call("c1", [1], [10])
    c2 = call("c2", [1, 10, 2], [11], retokenized=True)
    c3 = call("c3", [1, 10, 2, 11, 3], [12])
    traj = run([c1, c2, c3])
    assert traj.excluded == [{"call_id": "c2", "choice_index": 0, "reason": "retokenized"}]
    # c3 still continues c1; c2's re-derived tokens are context there, not trained
    (seq,) = traj.sequences
    assert seq.call_ids == ["c1", "c3"] and not seq.retokenized
    assert seq.token_ids == [1, 10, 2, 11, 3, 12] and seq.loss_mask == [0, 1, 0, 0, 0, 1]
    sft = run([c1, c2, c3], options={"include_retokenized": True})
    (seq,) = sft.sequences
    assert seq.retokenized and sampled(seq) == [10, 11, 12]
    assert [lp is None for lp, m in zip(seq.logprobs, seq.loss_mask, strict=True) if m] == [
        False,
        True,
        False,
    ]


def test_calls_without_ids_and_error_calls():
    c1 = call("c1", [1], [10])
    c2 = call("c2", None, None, retokenized=True)
    c3 = call("c3", [1, 10, 2], [11], status="error")
    traj = run([c1, c2, c3])
    assert {(e["call_id"], e["reason"]) for e in traj.excluded} == {("c2", "no_ids"), ("c3", "error")}
    assert [s.call_ids for s in traj.sequences] == [["c1"]]
    with_errors = run([c1, c2, c3], options={"include_errors": True, "include_retokenized": True})
    assert [s.call_ids for s in with_errors.sequences] == [["c1", "c3"]]


def test_step_rewards_by_index_and_by_time_and_discount():
    c1 = call("c1", [1], [10], t=100)
    c2 = call("c2", [5], [20], t=200)  # a new sequence
    c3 = call("c3", [5, 20, 6], [21], t=300)
    events = [
        {"value": 0.2, "name": "step", "call_index": 0, "created_at": None},
        {"value": 0.3, "name": "tool_ok", "created_at": 250e-9},  # between c2 and c3 (epoch seconds)
        {"value": 0.9, "name": "late", "call_index": 7},  # no such call: not attached
    ]
    traj = run([c1, c2, c3], reward=1.0, events=events, options={"gamma": 0.5})
    first, second = traj.sequences
    assert first.step_rewards == [{"value": 0.2, "name": "step", "call_index": 0}]
    assert second.step_rewards == [{"value": 0.3, "name": "tool_ok", "call_index": 1}]
    assert (first.reward, second.reward) == (0.5, 1.0)


def test_weight_versions_in_order_of_use():
    c1 = call("c1", [1], [10, 11], version="v1")
    c1.choices[0].weight_versions = [WeightVersionSpan("v1", 0, 1), WeightVersionSpan("v2", 1, 2)]
    c2 = call("c2", [1, 10, 11, 2], [12], version="v2")
    c3 = call("c3", [1, 10, 11, 2, 12, 3], [13], version="v3")
    (seq,) = run([c1, c2, c3]).sequences
    assert seq.weight_versions == ["v1", "v2", "v3"]


def test_assemble_rollout_reads_the_rollout_row_and_round_trips():
    c1 = call("c1", [1], [10])
    row = {"rollout_id": "r1", "task_id": "t", "group_id": "g", "status": "completed", "reward": 2.0}
    traj = assemble_rollout(row, [c1])
    assert (traj.task_id, traj.group_id, traj.status, traj.sequences[0].reward) == (
        "t",
        "g",
        "completed",
        2.0,
    )
    assert Trajectory.from_dict(traj.to_dict()) == traj


def test_bad_options_and_bad_records_fail_loudly():
    with pytest.raises(ValueError, match="mode"):
        AssemblyOptions(mode="tree")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gamma"):
        AssemblyOptions(gamma=0.0)
    with pytest.raises(ValueError, match="regex"):
        AssemblyOptions(agent_match="(")
    bad = call("c1", [1], [10, 11])
    bad.choices[0].output_logprobs = [-1.0]
    with pytest.raises(ValueError, match="2 output ids but 1 logprobs"):
        assemble([bad], rollout_id="r1")
    for second in ([2], [1, 10, 5]):  # a new conversation, and one continuing the first call's
        with pytest.raises(ValueError, match="duplicate call_id"):
            assemble([call("c1", [1], [10]), call("c1", second, [3])], rollout_id="r1")
    longer = call("c2", [1, 10, 11, 5], [12, 13])
    longer.choices[0].output_logprobs = [-1.0, -2.0, -3.0]
    with pytest.raises(ValueError, match="c2 choice 0: 2 output ids but 3 logprobs"):
        assemble([call("c1", [1], [10, 11]), longer], rollout_id="r1")


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda s: s.loss_mask.__setitem__(0, 1), "prompt/tool token"),
        (lambda s: s.loss_mask.__setitem__(3, 0), "sampled token"),
        (lambda s: s.logprobs.__setitem__(3, None), "logprobs differ"),
        (lambda s: s.logprobs.__setitem__(5, -1.0), "mask 0 but logprob"),
        (lambda s: s.token_ids.__setitem__(5, 999), "prompt ids"),
        (lambda s: s.token_ids.append(1), "token_ids"),
    ],
)
def test_check_invariants_names_the_broken_promise(corrupt, message):
    calls = [call("c1", [1, 2, 3], [10, 11]), call("c2", [1, 2, 3, 10, 11, 50, 51], [12])]
    traj = assemble(calls, rollout_id="r1")
    corrupt(traj.sequences[0])
    with pytest.raises(InvariantError, match=message):
        check_invariants(calls, traj)


def test_check_invariants_catches_duplicates_and_omissions():
    calls = [call("c1", [1], [10]), call("c2", [7], [20])]
    traj = assemble(calls, rollout_id="r1")
    twice = Trajectory("r1", None, None, [traj.sequences[0], traj.sequences[0], traj.sequences[1]])
    with pytest.raises(InvariantError, match="trained twice"):
        check_invariants(calls, twice)
    with pytest.raises(InvariantError, match="neither trained nor excluded"):
        check_invariants(calls, Trajectory("r1", None, None, traj.sequences[:1]))


def test_event_times_in_every_stored_form():
    when = datetime(2025, 1, 31, 12, 0, 0, 500000, tzinfo=UTC)
    ns = 1738324800_500000000
    assert time_ns(when) == time_ns("2025-01-31T12:00:00.5Z") == time_ns("2025-01-31T12:00:00.500000") == ns
    assert time_ns(ns) == ns and time_ns(1738324800.5) == ns
    with pytest.raises(ValueError, match="event time"):
        time_ns([1])
    c1, c2 = call("c1", [1], [10], t=ns - 10), call("c2", [5], [20], t=ns + 10)
    traj = run([c1, c2], events=[{"value": 1.0, "name": None, "created_at": "2025-01-31T12:00:00.5Z"}])
    assert traj.sequences[0].step_rewards == [{"value": 1.0, "name": None, "call_index": 0}]


def _packed_calls(arrays: bool) -> list[CallRecord]:
    calls = [call("c1", [1, 2, 3], [10, 11]), call("c2", [1, 2, 3, 10, 11, 50, 51], [12])]
    if arrays:  # records holding numpy arrays (their blobs keep the arrays' types)
        for c in calls:
            c.prompt_ids = np.array(c.prompt_ids, dtype=np.int32)
            for ch in c.choices:
                ch.output_ids = np.array(ch.output_ids, dtype=np.int32)
                ch.output_logprobs = np.array(ch.output_logprobs, dtype=np.float64)
    return calls


@pytest.mark.parametrize("arrays", [False, True])
def test_assembled_sequences_are_packed_and_read_as_lists(arrays):
    calls = _packed_calls(arrays)
    traj = assemble(calls, rollout_id="r1")
    seq = traj.sequences[0]
    ids, mask, lps = seq.arrays()
    assert ids.dtype == np.int32 and mask.dtype == np.int8  # ids that fit int32 are packed so, as stored
    assert lps.dtype == np.float64
    assert all(a is b for a, b in zip(seq.arrays(), (ids, mask, lps), strict=True))  # held, not copied
    check_invariants(calls, traj)
    assert all(a is b for a, b in zip(seq.arrays(), (ids, mask, lps), strict=True))  # checked without lists
    assert trajectory_json(traj) == orjson.dumps(traj.to_dict())  # arrays serialize as the lists would
    assert seq.token_ids == [1, 2, 3, 10, 11, 50, 51, 12]
    assert seq.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert seq.logprobs == [None, None, None, -0.51, -0.511, None, None, -0.512]
    assert type(seq.token_ids) is list and seq.token_ids is seq.token_ids  # made once, then kept
    assert seq.arrays().token_ids.tolist() == seq.token_ids  # from the list now
    listed = Sequence(**{k: v for k, v in seq.to_dict().items()})
    assert listed == seq and Trajectory.from_dict(orjson.loads(trajectory_json(traj))) == traj


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda ids, mask, lps: mask.__setitem__(0, 1), "prompt/tool token"),
        (lambda ids, mask, lps: mask.__setitem__(3, 0), "sampled token"),
        (lambda ids, mask, lps: lps.__setitem__(3, np.nan), "logprobs differ"),
        (lambda ids, mask, lps: lps.__setitem__(3, lps[3] + 1e-9), "logprobs differ"),
        (lambda ids, mask, lps: lps.__setitem__(5, -1.0), "mask 0 but logprob"),
        (lambda ids, mask, lps: ids.__setitem__(5, 999), "prompt ids"),
        (lambda ids, mask, lps: ids.__setitem__(3, 999), "output ids"),
    ],
)
@pytest.mark.parametrize("arrays", [False, True])
def test_check_invariants_verifies_packed_sequences(corrupt, message, arrays):
    calls = _packed_calls(arrays)
    traj = assemble(calls, rollout_id="r1")
    corrupt(*traj.sequences[0].arrays())  # the arrays themselves (shared), before any list is made
    with pytest.raises(InvariantError, match=message):
        check_invariants(calls, traj)


@pytest.mark.parametrize("arrays", [False, True])
def test_arrays_of_an_assembled_and_a_list_built_sequence_agree(arrays):
    """``Sequence.arrays()``: the assembly's arrays as held (ids of the blobs' width), a list-built copy's
    converted (int64), with the same values; both pass the invariants."""
    calls = _packed_calls(arrays)
    traj = assemble(calls, rollout_id="r1")
    listed = Trajectory.from_dict(orjson.loads(trajectory_json(traj)))
    assert type(listed.sequences[0].token_ids) is list  # as parsed from JSON
    for seq, other in zip(traj.sequences, listed.sequences, strict=True):
        held, made = seq.arrays(), other.arrays()
        assert held.token_ids.dtype == np.int32 and made.token_ids.dtype == np.int64
        assert [a.dtype for a in held[1:]] == [a.dtype for a in made[1:]] == [np.int8, np.float64]
        for a, b in zip(held, made, strict=True):
            np.testing.assert_array_equal(a, b)
    check_invariants(calls, listed)


def test_packed_logprob_nan_reads_as_none_and_is_written_as_null():
    seq = Sequence(np.array([5, 6]), np.array([0, 1], dtype=np.int8), np.array([np.nan, -0.25]))
    assert seq.logprobs == [None, -0.25] and seq.to_dict()["logprobs"] == [None, -0.25]
    traj = Trajectory("r", None, None, [seq])
    assert orjson.loads(trajectory_json(traj))["sequences"][0]["logprobs"] == [None, -0.25]


def test_check_invariants_compares_ids_of_another_integer_type_by_value():
    """Packed ids wider than the calls' blobs (int64 for int32 blobs) are compared by value: equal values
    pass, and an id that only agrees modulo 2**32 does not."""
    calls = _packed_calls(arrays=True)
    traj = assemble(calls, rollout_id="r1")
    seq = traj.sequences[0]
    wide = seq.arrays().token_ids.astype(np.int64)
    seq.token_ids = wide
    check_invariants(calls, traj)
    for at, message in ((1, "prompt ids"), (4, "output ids")):
        corrupt = wide.copy()
        corrupt[at] += 2**32
        seq.token_ids = corrupt
        with pytest.raises(InvariantError, match=message):
            check_invariants(calls, traj)


def test_one_sequence_from_float32_and_float64_logprob_blobs():
    """Logprobs exact in float32 are stored so, others as float64: one sequence may join both."""
    c1 = call("c1", [1], [0, 500])  # -0.5, -1.0
    c2 = call("c2", [1, 0, 500, 2], [11])  # -0.511
    assert [c.choices[0].logprobs[:1] for c in token_calls([c1, c2])] == [b"f", b"d"]
    (seq,) = run([c1, c2]).sequences
    assert seq.logprobs == [None, -0.5, -1.0, None, -0.511]
