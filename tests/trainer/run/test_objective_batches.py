"""Groups of trajectories → sft and dpo batches, and the offline sources' selection and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracegym.trainer.recipe import RecipeError, TrainRecipe
from tracegym.trainer.run.objective_batches import (
    EmptySourceError,
    check_source,
    dpo_batch,
    group_pair,
    import_files,
    in_runs,
    read_source,
    sft_batch,
    take_groups,
)
from tracegym.trainer.settings import DpoConfig, SftConfig
from tracegym.types import Sequence, Trajectory


def _traj(rid: str, reward: float | None, prompt: list[int], reply: list[int], group: str = "g") -> Trajectory:
    ids = prompt + reply
    seq = Sequence(ids, [0] * len(prompt) + [1] * len(reply), [None] * len(prompt) + [-1.0] * len(reply))
    return Trajectory(rollout_id=rid, task_id="t", reward=reward, sequences=[seq], group_id=group)


def test_sft_keeps_the_rollouts_that_pass_the_filter() -> None:
    groups = [("g", [_traj("a", 1.0, [1, 2], [3]), _traj("b", 0.0, [1, 2], [4]), _traj("c", None, [1, 2], [5])])]
    batch, stats = sft_batch(groups, SftConfig(min_reward=1.0))
    assert batch is not None and [s.token_ids.tolist() for s in batch.samples] == [[1, 2, 3]]
    assert stats["sft_rollouts"] == 1 and stats["rollouts"] == 3
    everything, _ = sft_batch(groups, SftConfig())  # no filter: demonstrations without a reward too
    assert everything is not None and len(everything) == 3
    nothing, stats = sft_batch(groups, SftConfig(min_reward=2.0))
    assert nothing is None and stats["sft_rollouts"] == 0


def test_imported_sequences_without_logprobs_train_in_sft() -> None:
    seq = Sequence([1, 2, 3], [0, 1, 1], [None, None, None])
    batch, _ = sft_batch([("g", [Trajectory("a", "t", None, [seq], "g")])], SftConfig())
    assert batch is not None and batch.samples[0].engine_logprobs.tolist() == [0.0, 0.0, 0.0]


def test_dpo_pairs_best_against_worst_with_the_same_prompt() -> None:
    g1 = [_traj("a", 0.2, [1, 2], [3]), _traj("b", 1.0, [1, 2], [4, 4]), _traj("c", 0.0, [1, 2], [5])]
    g2 = [_traj("d", 1.0, [1, 2], [3]), _traj("e", 0.0, [9, 2], [4])]  # another prompt
    g3 = [_traj("f", 0.5, [1], [3]), _traj("h", 0.5, [1], [4])]  # equal rewards
    batch, stats = dpo_batch([("g1", g1), ("g2", g2), ("g3", g3)], DpoConfig())
    assert batch is not None and stats["pairs"] == 1
    assert stats["pairs_skipped/prompt_differs"] == 1 and stats["pairs_skipped/equal_rewards"] == 1
    chosen, rejected = batch.samples
    assert chosen.chosen and not rejected.chosen and chosen.pair == rejected.pair == 0
    assert chosen.token_ids.tolist() == [1, 2, 4, 4] and rejected.token_ids.tolist() == [1, 2, 5]
    assert group_pair(g1, min_margin=1.0) == (None, "equal_rewards")  # 1.0 - 0.0 is not more than 1.0


def test_in_runs_selects_training_and_imported_groups_by_name() -> None:
    assert in_runs("quick-0123456789abcdef-train-3", ["quick"])
    assert in_runs("demos-import-12", ["demos"])
    assert not in_runs("quick-0123456789abcdef-eval0-1", ["quick"])  # evaluations are not examples
    assert not in_runs("quickstart-0123456789abcdef-train-3", ["quick"])
    assert not in_runs(None, ["quick"]) and not in_runs("grp_x", ["quick"])


def test_read_source_groups_the_lines_of_the_runs() -> None:
    def line(rid: str, gid: str) -> str:
        return json.dumps({"rollout_id": rid, "task_id": "t", "reward": 1.0, "group_id": gid, "sequences": []})

    lines = [line("a", "r-import-1"), line("b", "other-import-1"), line("c", "r-import-1"), line("d", "r-import-2")]
    got = read_source(lines, ["r"])
    assert [(g, [t.rollout_id for t in ts]) for g, ts in got] == [("r-import-1", ["a", "c"]), ("r-import-2", ["d"])]


def test_an_empty_source_says_how_many_rollouts_it_looked_at() -> None:
    groups = [("g", [_traj("a", 0.0, [1], [2]), _traj("b", 0.5, [1], [3])])]
    with pytest.raises(EmptySourceError, match=r"sft: 0 of the 2 completed rollouts of runs \['r'\] in the store are "
                                               r"examples with reward >= 1.0"):
        check_source("sft", groups, ["r"], SftConfig(min_reward=1.0), DpoConfig())
    with pytest.raises(EmptySourceError, match=r"dpo: 0 of the 1 groups \(2 completed rollouts\)"):
        check_source("dpo", groups, ["r"], SftConfig(), DpoConfig(min_margin=0.5))
    with pytest.raises(EmptySourceError, match="0 of the 0 completed rollouts"):
        check_source("sft", [], ["r"], SftConfig(), DpoConfig())


def test_take_groups_cycles() -> None:
    src = [(f"g{i}", [_traj(f"r{i}{k}", 1.0, [1], [2]) for k in range(2)]) for i in range(3)]
    got, pos = take_groups(src, 2, "dpo", batch_size=2, group_size=4)
    assert [g for g, _ in got] == ["g2", "g0"] and pos == 4
    got, pos = take_groups(src, 0, "sft", batch_size=2, group_size=2)  # 4 rollouts: two groups of two
    assert [g for g, _ in got] == ["g0", "g1"] and pos == 2


class _ImportClient:
    """Answers ``POST /api/import`` as the gateway does, or refuses the records of ``refuse``."""

    def __init__(self, refuse: str | None = None) -> None:
        self.bodies: list[dict] = []
        self.refuse = refuse

    def post(self, path: str, body: dict, what: str) -> dict:
        from tracegym.client import GatewayError

        assert path == "/api/import"
        if self.refuse and body["name"] == self.refuse:
            raise GatewayError("400: line 2: messages[1] calls tool 'search', but the record offers tools []")
        self.bodies.append(body)
        return {"groups": len(body["records"]), "skipped": 0, "rollouts": len(body["records"]), "calls": 0}


def test_dataset_files_are_imported_under_their_name_and_read_beside_the_runs(tmp_path: Path) -> None:
    demos, pairs = tmp_path / "demos.v2.jsonl", tmp_path / "pairs.jsonl"
    demos.write_text('{"messages": []}\n\n{"messages": []}\n')
    pairs.write_text('{"prompt": [], "chosen": [], "rejected": []}\n')
    assert SftConfig(runs=["first"], files=[demos]).sources() == ["first", "demos.v2"]
    client = _ImportClient()
    import_files(client, "sft", [demos])
    import_files(client, "dpo", [pairs])
    assert [(b["name"], b["format"], b["lines"]) for b in client.bodies] == [("demos.v2", "chat", [1, 3]),
                                                                           ("pairs", "dpo", [1])]
    with pytest.raises(RecipeError, match=r"sft.files: .*demos.v2.jsonl: 400: line 2: messages\[1\] calls tool"):
        import_files(_ImportClient(refuse="demos.v2"), "sft", [demos])
    with pytest.raises(RecipeError, match=r"dpo.files: no such file: .*missing.jsonl"):
        import_files(client, "dpo", [tmp_path / "missing.jsonl"])


def test_dataset_files_are_relative_to_the_recipe_and_named_plainly(tmp_path: Path) -> None:
    recipe = TrainRecipe(model="tiny-random", data={"path": "train.jsonl"}, agent={"target": "agent:agent"},
                         sft={"files": ["demos.jsonl"]}, dpo={"files": ["/abs/pairs.jsonl"]})
    resolved = recipe.resolve_paths(tmp_path)
    assert resolved.sft.files == [tmp_path / "demos.jsonl"] and resolved.dpo.files == [Path("/abs/pairs.jsonl")]
    with pytest.raises(ValueError, match=r"the dataset's name .* may hold only letters"):
        SftConfig(files=["my demos.jsonl"])
