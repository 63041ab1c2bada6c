"""gpt-oss's template with its message loop in Python (``families/harmony_render.py``) renders what the official
template renders in transformers' sandbox: on every call of the family corpus's conversations, with and
without a generation prompt and with the template's own variables; the inputs it leaves to the template
give the template's text or error; its heads are kept per what the head reads."""

from __future__ import annotations

import hashlib
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import pytest

from tests.gateway.proxy.prompt import family_corpus as corpus
from tests.gateway.proxy.prompt.test_jinja_env import _reference
from tests.shared_tokenizers import ONE_WORKER, chat_tokenizer
from tracegym.gateway.proxy.prompt import jinja_env
from tracegym.gateway.proxy.prompt.families import FAMILIES
from tracegym.gateway.proxy.prompt.families.harmony_render import LOOP_MARK, TEMPLATE_SHA256, harmony_renderer
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer, TemplateRenderError

pytestmark = ONE_WORKER

CONVERSATIONS = 200
VARIABLES: list[dict[str, Any]] = [{}, {"reasoning_effort": "high", "model_identity": "You are X."},
                                   {"builtin_tools": ["browser", "python"]}]
TEMPLATE = Path(__file__).parents[4] / "modelfiles" / "templates" / "gpt_oss.jinja"


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    from tracegym.modelfiles.prepare import prepare_model

    return ChatTokenizer.from_dir(prepare_model("gptoss-tiny"))


def _prepared(tok: ChatTokenizer, messages: list[dict[str, Any]], tools: list | None) -> tuple[list, list | None]:
    prepare = FAMILIES["gpt_oss"].prepare
    assert prepare is not None
    return prepare(messages, tools=tools, tool_choice=None, native_tools=True, tool_role="tool",
                   reasoning_field=True)


def _outcome(render: Any, *args: Any, **kwargs: Any) -> str:
    try:
        return render(*args, **kwargs)
    except (jinja2.TemplateError, TemplateRenderError, TypeError) as e:
        return f"error: {e}"


def test_it_is_built_for_the_official_template_only(tok: ChatTokenizer) -> None:
    source = TEMPLATE.read_text(encoding="utf-8")
    assert hashlib.sha256(source.encode()).hexdigest() == TEMPLATE_SHA256
    assert tok.templates["default"] == source and tok._renderers["default"] is not None
    assert harmony_renderer(source + "\n{{ '' }}") is None
    assert harmony_renderer(source.replace("Knowledge cutoff: 2024-06", "Knowledge cutoff: 2025-01")) is None
    qwen = chat_tokenizer("qwen3-tiny")
    assert set(qwen._renderers.values()) == {None}


def test_the_head_reads_only_what_its_memo_key_holds() -> None:
    """The template up to the loop reads, besides the names it sets itself, the messages (the first one's role,
    and its content when it is a system message; the rest become ``loop_messages``, which only the loop
    reads), the tools, its own variables and the date: the memo key holds the first message's system content,
    the tools, every template variable and today's date (the generation prompt is the loop's)."""
    source = TEMPLATE.read_text(encoding="utf-8")
    head = source[: source.index(LOOP_MARK)]
    names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(head))
    assigned = set(re.findall(r"\bset (\w+) =", head))
    assert names - assigned == {"messages", "tools", "builtin_tools", "strftime_now"}
    assert "add_generation_prompt" not in head
    statements = " ".join(re.findall(r"\{[%{].*?[%}]\}", head, re.DOTALL))
    assert re.findall(r"\bmessages\b\S*", statements) == [
        'messages[0].role', 'messages[0].role', 'messages[0].content', 'messages[1:]', 'messages']
    assert "loop_messages" not in head.split("set loop_messages = messages %}", 1)[1]


def test_corpus_renders_as_the_template(tok: ChatTokenizer) -> None:
    """Every call of the corpus conversations (each prefix ending before an assistant turn, and each
    conversation whole), with and without a generation prompt, under three sets of template variables:
    the renderer's text is the official template's in transformers' sandbox, never left to the template."""
    renderer = tok._renderers["default"]
    assert renderer is not None
    reference = _reference(tok.templates["default"])
    f = tok.family
    renders = 0
    for seed in range(CONVERSATIONS):
        turns, offered = corpus.conversation(seed, parallel=True, reasoning=True, tools=True)
        tools = corpus.TOOLS if offered else None
        messages = corpus.openai(turns)
        ends = [i for i, t in enumerate(turns) if t.role == "assistant"] + [len(turns)]
        for end in ends:
            msgs, visible = _prepared(tok, messages[:end], tools)
            for gen in (True, False):
                for variables in VARIABLES:
                    context = {**tok.special_tokens, **variables}
                    expected = reference.render(messages=msgs, tools=visible, documents=None,
                                                add_generation_prompt=gen, **context)
                    assert renderer.render(msgs, visible, gen, context) == expected, (seed, end, gen, variables)
                    renders += 1
        assert f.name == "gpt_oss"
    assert renders > 6 * CONVERSATIONS * 3
    assert len(renderer.heads) <= 2 * 5 * len(VARIABLES) and renderer.heads.hits > renders // 2


def _call(name: str = "add", arguments: Any = '{"a": 1}', **extra: Any) -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments, **extra}}


USER = {"role": "user", "content": "hi"}
CALL = {"role": "assistant", "content": None, "tool_calls": [_call()]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "3"}
LEFT_TO_THE_TEMPLATE: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([USER, {"role": "assistant", "content": "<|channel|>final<|message|>x"}, USER], {}),
    ([USER, {"role": "assistant", "content": "a", "reasoning_content": "<|channel|>analysis<|message|>"}, USER], {}),
    ([USER, {"role": "assistant", "content": "text", "reasoning_content": "why", "tool_calls": [_call()]}], {}),
    ([USER, RESULT], {}),
    ([USER, {"role": "assistant", "content": "a", "thinking": 5}, USER], {}),
    ([USER, {"role": "assistant", "content": "a", "reasoning_content": ["x"]}, USER], {}),
    ([USER, {**CALL, "tool_calls": [_call(content_type="<|constrain|>json")]}, RESULT], {}),
    ([USER, {**CALL, "tool_calls": [{"id": "c1", "name": "add", "arguments": {}, "function": {}}]}, RESULT], {}),
    ([USER, {**CALL, "tool_calls": [_call(name=7)]}, RESULT], {}),
    ([USER], {"strftime_now": "not a function"}),
    ([USER], {"namespace": 1}),
]
RENDERED_HERE: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([USER, {"role": "system", "content": "later system"}, USER], {}),
    ([{"role": "developer", "content": "dev"}, USER], {"reasoning_effort": "low"}),
    ([USER, {"role": "ipython", "content": "x"}, USER], {}),
    ([USER, CALL, RESULT, RESULT, {"role": "assistant", "content": "done", "reasoning_content": ""}], {}),
    ([USER, {**CALL, "reasoning_content": "plan"}, RESULT], {}),
    ([USER, {**CALL, "reasoning_content": "plan"}, RESULT, {"role": "assistant", "content": "ok"}, USER], {}),
    ([USER, {**CALL, "tool_calls": [_call(arguments="not json"), _call("search", "")]}, RESULT], {}),
    ([USER, {**CALL, "tool_calls": [_call(arguments='[1, "é", {"x": null}]')]}, RESULT], {}),
    ([{"role": "system", "content": ""}, USER], {"model_identity": "", "builtin_tools": []}),
    ([USER], {"unrelated": {"a": [1, 2]}}),
]


@pytest.mark.parametrize("case", range(len(LEFT_TO_THE_TEMPLATE) + len(RENDERED_HERE)))
def test_other_inputs_render_or_fail_as_the_template_does(tok: ChatTokenizer, case: int) -> None:
    """Inputs the loop leaves to the template (None) and ones it writes itself: the gateway's render (text,
    or the error) is the template's in transformers' sandbox, with the offered tools and without."""
    renderer, reference = tok._renderers["default"], _reference(tok.templates["default"])
    assert renderer is not None
    left = case < len(LEFT_TO_THE_TEMPLATE)
    messages, variables = (LEFT_TO_THE_TEMPLATE + RENDERED_HERE)[case]
    for tools in (corpus.TOOLS, None):
        for gen in (True, False):
            msgs, visible = _prepared(tok, messages, tools)
            context = {**tok.special_tokens, **variables}
            ours = renderer.render(msgs, visible, gen, context)
            assert (ours is None) == left, (messages, variables)
            expected = _outcome(reference.render, messages=msgs, tools=visible, documents=None,
                                add_generation_prompt=gen, **context)
            if not left:
                assert ours == expected
            got = _outcome(tok.render, messages, tools=tools, add_generation_prompt=gen, **variables)
            assert got.startswith("error") == expected.startswith("error"), (got, expected)
            assert got == expected or got.startswith("error"), (messages, variables)


def test_the_head_is_kept_per_day(tok: ChatTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A head kept yesterday is not today's: the date (the template's clock) is in the key."""
    renderer = tok._renderers["default"]
    assert renderer is not None
    reference = _reference(tok.templates["default"])
    msgs, visible = _prepared(tok, [{"role": "system", "content": "day test"}, USER], corpus.TOOLS)
    context = dict(tok.special_tokens)
    for day in (datetime(2031, 5, 6, 23, 59, 59), datetime(2031, 5, 7, 0, 0, 1), datetime(2031, 5, 6, 12)):
        class Clock(datetime):
            @classmethod
            def now(cls, tz: Any = None) -> datetime:
                return day  # noqa: B023

        monkeypatch.setattr(jinja_env, "datetime", Clock)
        expected = reference.render(messages=msgs, tools=visible, documents=None, add_generation_prompt=True,
                                    **context)
        assert f"Current date: {day:%Y-%m-%d}" in expected
        assert renderer.render(msgs, visible, True, context) == expected
