"""The chat templates' jinja environment: its shortcuts and memos render exactly what transformers' sandbox
renders (every family's real template on corpus conversations, rendered twice so the memos are hit),
memoize only macros whose text is a function of what the key holds, and keep the sandbox's refusals."""

from __future__ import annotations

import jinja2
import jinja2.ext
import markupsafe
import pytest
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tests.gateway.proxy.prompt import family_corpus as corpus
from tests.shared_tokenizers import ONE_WORKER, chat_tokenizer
from tracegym.gateway.proxy.prompt import jinja_env
from tracegym.gateway.proxy.prompt.jinja_env import compile_template, memo_key
from tracegym.gateway.proxy.prompt.templating import prepare_messages

pytestmark = ONE_WORKER

MODELS = {"chatml": "tiny-random", "qwen3": "qwen3-tiny", "llama3": "llama3-tiny", "gemma3": "gemma3-tiny",
          "deepseek_v3": "deepseek3-tiny", "gpt_oss": "gptoss-tiny"}


def _reference(source: str) -> jinja2.Template:
    """transformers' environment as it configures it: the sandbox with nothing added."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[jinja_env._GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = jinja_env._tojson
    env.globals["raise_exception"] = jinja_env._raise_exception
    env.globals["strftime_now"] = jinja_env._strftime_now
    env.globals["namespace"] = jinja_env.TemplateNamespace
    return env.from_string(source)


@pytest.mark.parametrize("family", list(MODELS))
def test_renders_equal_the_plain_sandbox(family: str) -> None:
    tok = chat_tokenizer(MODELS[family])
    f = tok.family
    for seed in range(25):
        turns, offered = corpus.conversation(seed, parallel=f.parallel_calls, reasoning=f.reasoning is not None,
                                             tools=True)
        tools = corpus.TOOLS if offered else None
        name = tok.template_for(tools)
        msgs, visible = (f.prepare or prepare_messages)(
            corpus.openai(turns), tools=tools, tool_choice=None, native_tools=tok.native_tools(tools),
            tool_role=tok.tool_role, reasoning_field=tok._reasoning_field[name])
        fast, ref = compile_template(tok.templates[name]), _reference(tok.templates[name])
        for gen in (True, False, True):  # the second render of each conversation meets the memos
            inputs = {"messages": msgs, "tools": visible, "documents": None, "add_generation_prompt": gen,
                      **tok.special_tokens}
            assert fast.render(**inputs) == ref.render(**inputs), (family, seed)
    if family == "gpt_oss":  # its tool signatures are memoized macros, hit on every render after the first
        t = tok._compiled["default"]
        assert t.environment.memoized == {"render_tool_namespace", "render_typescript_type", "render_builtin_tools"}


def test_memo_keys_tell_apart_what_renders_differently() -> None:
    values = [1, 1.0, True, "1", None, -0.0, 0.0, float("nan"), [1], (1,), {"a": 1, "b": 2}, {"b": 2, "a": 1}]
    keys = [memo_key(v) for v in values]
    assert len(set(keys)) == len(values)
    assert memo_key({"x": [1, {"y": "z"}]}) == memo_key({"x": [1, {"y": "z"}]})
    with pytest.raises(jinja_env._Unkeyable):
        memo_key(jinja2.Undefined())
    with pytest.raises(jinja_env._Unkeyable):
        memo_key(["ok", markupsafe.Markup("<b>")])


def test_only_macros_whose_text_the_key_decides_are_memoized() -> None:
    source = """\
{%- macro pure(xs) %}{% for x in xs %}{{ x.name }}{{ "," if not loop.last }}{% endfor %}{% endmacro -%}
{%- macro reads_context() %}{{ suffix }}{% endmacro -%}
{%- macro reads_a_variable() %}{{ top }}{% endmacro -%}
{%- macro sets_a_namespace(ns) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{% endmacro -%}
{%- macro uses_the_clock() %}{{ strftime_now("%H:%M:%S.%f") }}{% endmacro -%}
{%- macro with_caller() %}[{{ caller() }}]{% endmacro -%}
{%- set top = messages[0].content -%}
{%- set ns = namespace(n=0) -%}
{{ pure(messages) }}|{{ pure(messages) }}|{{ reads_context() }}|{{ reads_a_variable() }}|\
{{ sets_a_namespace(ns) }}{{ sets_a_namespace(ns) }}|{% call with_caller() %}c{% endcall %}|{{ uses_the_clock() }}"""
    t = compile_template(source)
    assert t.environment.memoized == {"pure", "reads_context", "uses_the_clock"}
    one = t.render(messages=[{"name": "a", "content": "A"}, {"name": "b", "content": "B"}], suffix="!")
    assert one.startswith("a,b|a,b|!|A|12|[c]|")
    two = t.render(messages=[{"name": "a", "content": "C"}, {"name": "b", "content": "D"}], suffix="?")
    assert two.startswith("a,b|a,b|?|C|12|[c]|")  # the context name it reads is in its key
    assert t.environment.memo.hits >= 2
    assert not any(k[0] == "uses_the_clock" for k in t.environment.memo._data)  # a function is no key


def _outcome(template: jinja2.Template, **inputs: object) -> str:
    try:
        return template.render(**inputs)
    except SecurityError as e:
        return f"SecurityError: {e}"


def test_the_sandbox_still_refuses() -> None:
    msgs = [{"role": "user", "content": "x"}]
    refused = ("{{ messages.pop() }}", "{{ messages[0].clear() }}", "{{ ''.__class__.__mro__ }}",
               "{% set ns = namespace(_x=1) %}", "{% set ns = namespace() %}{% set ns._x = 1 %}")
    quiet = ("{{ '{0.__class__}'.format(messages) }}", "{{ ''.__class__ }}", "{{ messages[0]._private }}")
    for source in refused + quiet:
        fast, ref = _outcome(compile_template(source), messages=msgs), _outcome(_reference(source), messages=msgs)
        assert fast == ref and (fast.startswith("SecurityError") == (source in refused)), source
    ok = compile_template("{{ messages[0].role }}{{ messages[0].nope }}{{ messages[0].items()|list|length }}"
                          "{% for m in messages %}{{ loop.index }}{{ m.content.upper() }}{% endfor %}")
    assert ok.render(messages=msgs) == "user21X"


def test_calls_made_without_the_sandbox_checks_render_as_the_sandbox_does() -> None:
    """Macros (memoized or not, with defaults, varargs, kwargs, a caller, inside loops), ``namespace()``,
    ``raise_exception`` and ``strftime_now`` are called as the context would call them: the same text, the
    same errors."""
    source = """\
{%- macro pure(a, b=2) %}{{ a }}-{{ b }}{% endmacro -%}
{%- macro reads(a) %}{{ a }}{{ suffix }}{{ varargs|length }}{{ kwargs|length }}{% endmacro -%}
{%- macro wrap() %}[{{ caller(1) }}]{% endmacro -%}
{%- for m in messages %}{% set ns = namespace(n=loop.index) %}{{ pure(m.content) }}|{{ pure(m.content, b=ns.n) }}|\
{{ reads(m.content, 1, 2, k=3) }}|{% call(x) wrap() %}{{ x }}{{ m.content }}{% endcall %};{% endfor -%}
{{ strftime_now("%Y") }}"""
    msgs = [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]
    fast, ref = compile_template(source), _reference(source)
    for _ in range(2):  # the second render meets the memos
        assert fast.render(messages=msgs, suffix="!") == ref.render(messages=msgs, suffix="!")
    for failing in ("{{ raise_exception('no ' + messages[0].content) }}",
                    "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, 2) }}",
                    "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(b=1) }}",
                    "{{ namespace(1, 2) }}", "{{ strftime_now() }}"):
        errors = []
        for template in (compile_template(failing), _reference(failing)):
            with pytest.raises(Exception) as caught:
                template.render(messages=msgs)
            errors.append((type(caught.value), str(caught.value)))
        assert errors[0] == errors[1], failing


def test_tojson_memo_writes_what_json_dumps_writes() -> None:
    """``tojson`` of dicts and lists is memoized: values that differ only in type, float bits or key order
    keep their own texts, on the first render and on the memo's hits."""
    import json

    t = compile_template("{{ x|tojson }}|{{ x|tojson(indent=2) }}|{{ x|tojson(sort_keys=true) }}")
    values = [{"a": 1}, {"a": 1.0}, {"a": True}, {"a": -0.0}, {"a": 0.0}, {"a": float("nan")}, {"b": 1, "a": 2},
              {"a": 2, "b": 1}, [1, "é"], ["1"], [], {}, "s", 1]
    for _ in range(2):
        for x in values:
            expected = [json.dumps(x, ensure_ascii=False), json.dumps(x, ensure_ascii=False, indent=2),
                        json.dumps(x, ensure_ascii=False, sort_keys=True)]
            assert t.render(x=x) == "|".join(expected), x
    assert t.environment.memo.hits >= 3 * 12
