"""Chat templating without transformers: parity with ``apply_chat_template``, normalisation, tools."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tracegym.gateway.proxy.prompt.templating import ChatTokenizer, TemplateRenderError
from tracegym.gateway.proxy.prompt.tools import parse_tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": " Why did the chicken cross the road?  "},
        {"role": "user", "content": "Why?\n\n  Tell me!\t"},
        {"role": "assistant", "content": "To get to the other side."},
        {"role": "user", "content": "é 日本語 😀 <b>html</b> {{ not jinja }}"},
    ],
    [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "\n"},
        {"role": "user", "content": "ok"},
    ],
    [{"role": "user", "content": "a special token in text: <|im_end|> and <|im_start|>"}],
    [
        {"role": "user", "content": "  leading and trailing spaces  "},
        {"role": "assistant", "content": "x" * 500},
    ],
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_tok(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_matches_transformers_token_for_token(tok, hf_tok, conversation, generation_prompt) -> None:
    expected = hf_tok.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    assert tok.apply(conversation, add_generation_prompt=generation_prompt) == list(expected)
    text = hf_tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
    assert tok.render(conversation, add_generation_prompt=generation_prompt) == text


def test_encode_decode_and_properties(tok, hf_tok) -> None:
    text = "<|im_start|>user\nhé llo<|im_end|>\n"
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and 2 in ids
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhé llo\n"
    assert tok.eos_token_ids[0] == tok.tokenizer.token_to_id("<|im_end|>") == 2
    assert 0 in tok.eos_token_ids  # from generation_config.json
    assert tok.vocab_size == len(hf_tok) == 49152
    assert {0, 1, 2} <= tok.special_ids and 100 not in tok.special_ids
    assert tok.name_or_path.endswith("tiny-random")


def _copy_tokenizer(src: Path, dst: Path, *, template_in: str) -> Path:
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    source = (src / "chat_template.jinja").read_text()
    config.pop("chat_template", None)
    if template_in == "config":
        config["chat_template"] = source
    elif template_in == "json":
        (dst / "chat_template.json").write_text(json.dumps({"chat_template": source}))
    elif template_in == "named":
        config["chat_template"] = [
            {"name": "default", "template": source},
            {"name": "tool_use", "template": "TOOLS:{{ tools | length }}"},
        ]
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("template_in", ["config", "json", "named"])
def test_template_locations(tok, tiny_model_dir, tmp_path, template_in) -> None:
    other = ChatTokenizer.from_dir(_copy_tokenizer(tiny_model_dir, tmp_path / "t", template_in=template_in))
    for conversation in CONVERSATIONS:
        assert other.render(conversation) == tok.render(conversation)
    if template_in == "named":  # the tool_use template is chosen when tools are given
        assert other.render(CONVERSATIONS[0], tools=[WEATHER]) == "TOOLS:1"


def test_missing_files_and_template(tiny_model_dir, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        ChatTokenizer.from_dir(tmp_path)
    d = _copy_tokenizer(tiny_model_dir, tmp_path / "t", template_in="none")
    bare = ChatTokenizer.from_dir(d)
    assert bare.encode("<|im_start|>hi") == [1, *bare.encode("hi")]
    with pytest.raises(TemplateRenderError, match="no chat template"):
        bare.render(CONVERSATIONS[0])


def test_openai_shapes_are_normalised(tok) -> None:
    base = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]
    odd = [
        {"role": "developer", "content": [{"type": "text", "text": "S"}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "name": None,
        },
        {"role": "assistant", "content": None, "refusal": None},
    ]
    assert tok.render(odd) == tok.render(base)
    with pytest.raises(ValueError, match="image_url"):
        tok.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match="role"):
        tok.render([{"content": "no role"}])
    with pytest.raises(ValueError, match="non-empty"):
        tok.render([])


def test_tools_are_injected_hermes_style(tok) -> None:
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    text = tok.render(msgs, tools=[WEATHER])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools\n")
    assert f"<tools>\n{json.dumps(WEATHER, ensure_ascii=False)}\n</tools>" in system
    assert '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>' in system
    assert "SmolLM" not in text  # our system message replaces the template's default one
    with_system = tok.render([{"role": "system", "content": "Be brief."}, *msgs], tools=[WEATHER])
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert tok.render(msgs, tools=[WEATHER], tool_choice="none") == tok.render(msgs)
    assert tok.render(msgs, tools=[WEATHER], tool_choice="auto") == text
    assert "You must call at least one function." in tok.render(msgs, tools=[WEATHER], tool_choice="required")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert "You must call the function get_weather." in tok.render(msgs, tools=[WEATHER], tool_choice=named)
    with pytest.raises(ValueError, match="tool_choice"):
        tok.render(msgs, tools=[WEATHER], tool_choice="sometimes")
    with pytest.raises(ValueError, match="tools must be"):
        tok.render(msgs, tools=[{"type": "function"}])


def test_tool_calls_and_results_render_as_the_model_writes_them(tok) -> None:
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    text = tok.render(msgs, tools=[WEATHER])
    reply = '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>'
    assert reply in text
    assert '<|im_start|>tool\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n' in text
    assert text.endswith("<|im_start|>assistant\n")
    # what the model would sample for that reply parses back into the same call
    sampled = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(sampled)
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    as_user = ChatTokenizer(tok.tokenizer, tok.templates, tok.special_tokens, tool_role="user")
    assert "<|im_start|>user\n<tool_response>\n" in as_user.render(msgs, tools=[WEATHER])


NATIVE = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}:{{ c.function.arguments | tojson }}</call>"
    "{% endfor %}\n{% endfor %}"
    "{% if tools %}TOOLS={{ tools | map(attribute='function.name') | join(',') }}{% endif %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_templates_that_know_tools_get_them(tok) -> None:
    native = ChatTokenizer(tok.tokenizer, {"default": NATIVE}, tok.special_tokens)
    assert native.native_tools() and not tok.native_tools()
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}]
    text = native.render(msgs, tools=[WEATHER])
    # (trim_blocks eats the newline after a block tag, as in transformers)
    assert text == '[user]q[assistant]<call>get_weather:{"city": "Paris"}</call>TOOLS=get_weather[assistant]'
    assert "TOOLS" not in native.render(msgs, tools=[WEATHER], tool_choice="none")


def test_jinja_environment_matches_transformers(tok) -> None:
    source = (
        "{% generation %}G{% endgeneration %}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
        "|{{ {'a': 'é<'} | tojson }}|{{ strftime_now('%Y') | length }}|{{ bos_token }}{{ eos_token }}"
        "{% set ns = namespace(x=1) %}{{ ns.x }}|{{ custom }}"
    )
    t = ChatTokenizer(tok.tokenizer, {"default": source}, tok.special_tokens)
    out = t.render([{"role": "user", "content": "one"}, {"role": "user", "content": "two"}], custom="K")
    assert out == 'Gone|{"a": "é<"}|4|<|im_start|><|im_end|>1|K'
    failing = ChatTokenizer(tok.tokenizer, {"default": "{{ raise_exception('roles must alternate') }}"}, {})
    with pytest.raises(TemplateRenderError, match="roles must alternate"):
        failing.render(CONVERSATIONS[0])
    sandboxed = ChatTokenizer(tok.tokenizer, {"default": "{{ ''.__class__ }}{{ messages.append(1) }}"}, {})
    with pytest.raises(TemplateRenderError, match=r"unsafe|not safely callable"):
        sandboxed.render(CONVERSATIONS[0])


def test_a_template_that_writes_the_date_is_cached_per_day(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss's template writes today's date (``strftime_now("%Y-%m-%d")``): its renders are cached with
    the date in the key, so a new day renders anew; a template that writes the time is never cached."""
    import datetime as dt

    from tracegym.gateway.proxy.prompt import jinja_env, templating
    from tracegym.modelfiles.prepare import prepare_model

    tok = ChatTokenizer.from_dir(prepare_model("gptoss-tiny"))
    msgs = [{"role": "user", "content": "hi"}]
    first = tok.render(msgs, tools=[WEATHER])
    assert tok.render(msgs, tools=[WEATHER]) == first and tok._renders.hits == 1

    class Tomorrow(dt.datetime):
        @classmethod
        def now(cls, tz: object = None) -> dt.datetime:
            return dt.datetime(2031, 1, 2, 3, 4, 5)

    monkeypatch.setattr(templating, "datetime", Tomorrow)
    monkeypatch.setattr(jinja_env, "datetime", Tomorrow)
    later = tok.render(msgs, tools=[WEATHER])
    assert "Current date: 2031-01-02" in later and later != first and tok._renders.hits == 1
    timed = ChatTokenizer(tok.tokenizer, {"default": '{{ strftime_now("%H:%M") }}{{ messages[0].content }}'},
                          tok.special_tokens, chat_format="chatml")
    assert timed._renders is None
