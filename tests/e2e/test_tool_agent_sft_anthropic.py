"""The tools-API agent on the Anthropic SDK (``examples/tool_agent_sft/recipe-anthropic.yaml``: ``tool_use``
and ``tool_result`` blocks of the Messages API), shortened as test_tool_agent_sft.py shortens the OpenAI
one: SmolLM2-135M is fine-tuned on the example's OpenAI-form demonstrations, then trained with GRPO on the
Anthropic agent's reward, through the whole product. The held-out split is evaluated before, at the end of
the sft phase and at the end: sft must make the model call the calculator through the Messages API, and
GRPO must bring the valid-call rate to 0.75 or more, no lower than the sft-only model's (up to 0.9), and
raise the reward by 0.15 or to 0.75. That sft on OpenAI-form conversations teaches this agent rests on the
gateway rendering the agent's Messages conversations to the demonstrations' tokens, which the fast test
checks."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from tests.e2e.conftest import sft_grpo_evaluations
from tracegym.gateway.api.imports import render_calls
from tracegym.gateway.proxy.anthropic.request import parse_messages
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples" / "tool_agent_sft"
RECIPE = EX / "recipe-anthropic.yaml"
SFT_STEPS, GRPO_STEPS = 2, 4
"""Four GRPO steps, the recipe's own: with three, four runs ended at 0.91-1.00 held-out reward but one stopped at
0.72 from the sft phase's 0.69 (valid calls 0.75 both), short of the rise asked."""
EVAL_TASKS = 16  # x 2 samples


def test_messages_conversations_render_to_the_demonstrations_tokens(tiny_model_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each demonstration's two prompts (the question; the question, the call and its result) as the agent
    sends them on the Messages API, rendered by the gateway (tiny-random has SmolLM2's tokenizer and chat
    template), are the prompt tokens the import renders from the OpenAI-form demonstration."""
    tok = ChatTokenizer.from_dir(tiny_model_dir)
    monkeypatch.syspath_prepend(str(EX))  # as the runner loads an agent: its folder on sys.path
    tools = runpy.run_path(str(EX / "agent_anthropic.py"))["TOOLS"]
    demos = [json.loads(x) for x in (EX / "demos.jsonl").read_text().splitlines()]
    assert len(demos) == 32
    for demo in demos:
        question, call, result, _ = demo["messages"]
        fn = call["tool_calls"][0]["function"]
        conversation = [
            {"role": "user", "content": question["content"]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_0", "name": fn["name"],
                                               "input": json.loads(fn["arguments"])}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0",
                                          "content": result["content"]}]},
        ]  # fmt: skip
        expected = {i: prompt for i, prompt, _ in render_calls(tok, demo["messages"], demo["tools"])}
        for i, messages in ((1, conversation[:1]), (3, conversation)):
            req = parse_messages({"model": "m", "max_tokens": 40, "tools": tools, "messages": messages})
            assert tok.apply(req.messages, req.tools, tool_choice=req.tool_choice) == expected[i], (i, demo)


@pytest.mark.slow
@pytest.mark.learns
def test_sft_then_grpo_teaches_the_messages_tools_api(tmp_path: Path) -> None:
    before, sft, grpo = sft_grpo_evaluations(RECIPE, tmp_path, SFT_STEPS, GRPO_STEPS, EVAL_TASKS,
                                             "anthropic tool agent")
    # the untrained model never calls the tool; it may state a product by chance
    assert before["emitted/valid_call"] <= 0.05 and before["reward_mean"] <= 0.15, before
    # measured in five runs: valid calls 0.00 -> 0.62-0.72 after sft -> 0.88-0.97; reward 0.000 -> 0.34-0.62
    # -> 0.88-0.97, a rise of 0.34-0.59. 0.75, not 0.8: the lowest, 0.88, is 28 of 32 rollouts; 0.8 needs 26
    assert sft["emitted/valid_call"] >= 0.3, (before, sft)
    # (reward in two later runs: 0.50 -> 1.00, 0.59 -> 0.88). Where sft leaves less room than the rise asked, GRPO
    # must reach 0.75, and where sft's valid calls pass 0.9, 0.9 is asked (32 rollouts cannot tell them apart there)
    assert grpo["emitted/valid_call"] >= max(0.75, min(sft["emitted/valid_call"], 0.9)), (sft, grpo)
    assert grpo["reward_mean"] >= min(sft["reward_mean"] + 0.15, 0.75), (sft, grpo)
