"""The model's own chat template, rendered without transformers (the gateway never imports torch).

``ChatTokenizer`` loads ``tokenizer.json`` with the ``tokenizers`` library and the chat template, bos/eos
and special tokens from ``tokenizer_config.json`` (or ``chat_template.jinja`` / ``chat_template.json``
as newer transformers saves them), and renders with a sandboxed jinja2 environment configured as
transformers configures it (``jinja_env.py``), so ``apply`` equals
``AutoTokenizer.apply_chat_template(..., tokenize=True)``.

OpenAI-shaped messages are normalised first (``prepare_messages``): ``content: null`` → ``""``, text parts
joined, ``developer`` → ``system``, keys with a None value dropped (as transformers does). Templates that
reference ``tools`` get them as-is; for the others (SmolLM2's plain ChatML) tools are injected hermes-style
into the system prompt, assistant ``tool_calls`` are rendered as ``<tool_call>`` text (see ``tools.py``),
and ``tool`` messages keep the ``tool`` role (ChatML renders it literally; pass ``tool_role="user"`` for
templates that reject it) with their content wrapped in ``<tool_response>\\n...\\n</tool_response>``.
An assistant message's ``reasoning_content`` is passed on to templates that read it (Qwen3) and written
into the content as ``<think>`` (``reasoning.join_reasoning``) for the others, so it is never lost.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer, normalizers

from tracegym.gateway.proxy.prompt.caches import BoundedLRU, SegmentEncoder, overlap, render_key
from tracegym.gateway.proxy.prompt.families import Family, detect, family
from tracegym.gateway.proxy.prompt.jinja_env import compile_template
from tracegym.gateway.proxy.prompt.reasoning import join_reasoning
from tracegym.gateway.proxy.prompt.tools import format_assistant_content, parse_arguments, tool_system_section


class TemplateRenderError(ValueError):
    """The chat template rejected the messages (``raise_exception`` in the template, or a bad shape)."""


# ----------------------------------------------------------------------------------------- normalisation


def _mapping(value: Any) -> bool:
    """``isinstance(value, Mapping)``, a plain dict (what parsed JSON holds) answered without the ABC check."""
    return type(value) is dict or isinstance(value, Mapping)


def content_text(content: Any) -> str:
    """OpenAI content (None, a string, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text", "output_text"):
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"unsupported content part {kind!r}: this model takes text parts only")
        return "\n".join(texts)
    raise ValueError(
        f"message content must be a string, null or a list of parts, got {type(content).__name__}"
    )



def check_tool_choice(tool_choice: Any) -> Any:
    """``None``/``"auto"`` → ``"auto"``; ``"none"``, ``"required"`` and a named function pass; else ValueError."""
    if tool_choice is None or tool_choice == "auto":
        return "auto"
    if tool_choice in ("none", "required"):
        return tool_choice
    if (
        isinstance(tool_choice, Mapping)
        and isinstance(tool_choice.get("function"), Mapping)
        and isinstance(tool_choice["function"].get("name"), str)
    ):
        return {"type": "function", "function": {"name": tool_choice["function"]["name"]}}
    raise ValueError(
        f"tool_choice must be 'auto', 'none', 'required' or a named function, got {tool_choice!r}"
    )


TEMPLATE_KWARGS_RESERVED = frozenset({"messages", "tools", "documents", "tool_choice", "add_generation_prompt"})
"""Keys ``chat_template_kwargs`` may not set: the request itself sets them (``add_generation_prompt`` is
always on for a chat completion)."""


def check_template_kwargs(value: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` as a fresh dict (None → empty); ValueError for a non-object or a reserved
    key."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"chat_template_kwargs must be an object, got {type(value).__name__}")
    if reserved := TEMPLATE_KWARGS_RESERVED & value.keys():
        raise ValueError(f"chat_template_kwargs cannot set {sorted(reserved)}: the request sets them")
    return dict(value)


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list) or not all(
        _mapping(t) and _mapping(t.get("function")) and t["function"].get("name")
        for t in tools
    ):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {'name', ...}} objects")
    return [dict(t) for t in tools]


def prepare_messages(
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    native_tools: bool,
    tool_role: str = "tool",
    reasoning_field: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Normalised messages and the ``tools`` the template should see (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    tools = check_tools(tools)
    choice = check_tool_choice(tool_choice)
    out: list[dict[str, Any]] = []
    for m in messages:
        if not _mapping(m) or not isinstance(m.get("role"), str):
            raise ValueError(f"each message must be an object with a string 'role', got {m!r}")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["role"] = "system" if m["role"] == "developer" else m["role"]
        msg["content"] = content_text(m.get("content"))
        if not reasoning_field and isinstance(msg.get("reasoning_content"), str):
            msg["content"] = join_reasoning(msg.pop("reasoning_content"), msg["content"])
        calls = msg.get("tool_calls") or []
        if native_tools:
            if calls:
                msg["tool_calls"] = [_native_call(c) for c in calls]
        elif calls:
            msg["content"] = format_assistant_content(msg["content"], calls)
            del msg["tool_calls"]
        elif msg["role"] == "tool":
            msg = {"role": tool_role, "content": f"<tool_response>\n{msg['content']}\n</tool_response>"}
        out.append(msg)
    visible_tools = tools if choice != "none" else None
    if native_tools or not visible_tools:
        return out, visible_tools
    section = tool_system_section(visible_tools, choice)
    if out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section}
    else:
        out.insert(0, {"role": "system", "content": section})
    return out, None


def _native_call(call: Any) -> dict[str, Any]:
    """A tool call for templates that render ``tool_calls`` themselves: arguments as an object."""
    if not _mapping(call) or not _mapping(call.get("function")):
        raise ValueError(
            f"tool_calls entries must look like {{'function': {{'name', 'arguments'}}}}: {call!r}"
        )
    fn = dict(call["function"])
    fn["arguments"] = parse_arguments(fn.get("arguments", {}))
    return {**call, "function": fn}


# ----------------------------------------------------------------------------------------------- loading


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _load_templates(d: Path, config: dict[str, Any]) -> dict[str, str]:
    """Named templates: ``chat_template.jinja`` > ``chat_template.json`` > tokenizer_config.json."""
    if (d / "chat_template.jinja").is_file():
        templates = {"default": (d / "chat_template.jinja").read_text(encoding="utf-8")}
        extra = d / "additional_chat_templates"
        if extra.is_dir():
            templates |= {p.stem: p.read_text(encoding="utf-8") for p in sorted(extra.glob("*.jinja"))}
        return templates
    raw = _read_json(d / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        return {t["name"]: t["template"] for t in raw}
    return {}


# ------------------------------------------------------------------------------------------ the tokenizer


_DATE_DIRECTIVES = frozenset("YmdbBaAyjeFDx%")
"""``strftime`` directives that write the date only (no hour, minute, second, time zone)."""


def _date_formats(sources: str) -> tuple[str, ...] | None:
    """The literal formats of the templates' ``strftime_now`` calls when every call has one that writes the
    date only (``()`` without calls); None when a call writes the time or its format is not a literal."""
    calls = re.findall(r"\bstrftime_now\b", sources)
    formats = [f for _, f in re.findall(r"\bstrftime_now\(\s*(['\"])(.*?)\1\s*\)", sources)]
    if len(formats) != len(calls) or not all(set(re.findall(r"%(.)", f)) <= _DATE_DIRECTIVES for f in formats):
        return None
    return tuple(sorted(set(formats)))


def _split_tokens(tokenizer: Tokenizer, added: dict[int, Any], sources: str) -> dict[str, int]:
    """The added tokens the tokenizer always splits a text on before tokenizing its pieces: the special ones
    that are not ``normalized``, and the others the templates write that no other added token overlaps (a
    ``normalized`` one only when the tokenizer has no normalizer, so it matches the text as written)."""
    plain = tokenizer.normalizer is None or (
        isinstance(tokenizer.normalizer, normalizers.Sequence) and len(tokenizer.normalizer) == 0)
    fixed = [(i, tok) for i, tok in added.items() if not (tok.lstrip or tok.rstrip or tok.single_word)]
    out = {tok.content: i for i, tok in fixed if tok.special and not tok.normalized}
    others = [(i, tok.content) for i, tok in fixed if tok.content not in out and tok.content in sources
              and (plain or not tok.normalized)]
    if others:
        contents = [tok.content for tok in added.values()]
        out |= {c: i for i, c in others if not any(overlap(c, other) for other in contents if other != c)}
    return out


class ChatTokenizer:
    """Chat template + fast tokenizer; pure and torch-free. Build it once per process with ``from_dir``."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        templates: dict[str, str],
        special_tokens: dict[str, Any],
        *,
        name_or_path: str = "",
        extra_eos_ids: list[int] | None = None,
        tool_role: str = "tool",
        chat_format: Family | str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.templates = templates
        self._compiled = {name: compile_template(src) for name, src in templates.items()}
        self.special_tokens = special_tokens  # bos_token, eos_token, ... as the template sees them
        self.tool_role = tool_role
        self._name_or_path = name_or_path
        added = tokenizer.get_added_tokens_decoder()
        self._special_ids = {i for i, tok in added.items() if tok.special}
        sources = "".join(templates.values())  # split where the template writes special tokens
        self.split_tokens = _split_tokens(tokenizer, added, sources)
        """Added tokens the tokenizer always splits on: text can be encoded piecewise around them (special
        tokens, and the other added tokens the templates write that no other one overlaps)."""
        self.family = (chat_format if isinstance(chat_format, Family) else family(chat_format) if chat_format
                       else detect(sources, {t.content for t in added.values()}, where=name_or_path or "the tokenizer"))
        """The model family (``families``): how messages are prepared and replies parsed."""
        self._keep_ids = {i for i, tok in added.items() if tok.content in self.family.keep_tokens}
        make = self.family.renderer
        self._renderers = {name: make(src) if make is not None else None for name, src in templates.items()}
        """Per template: the family's renderer of it in Python (``Family.renderer``), or None."""
        self.template_split_tokens = {t: i for t, i in self.split_tokens.items() if t in sources}
        """The split tokens the chat templates write (where rendered text is cut for piecewise encoding)."""
        self._encoder = SegmentEncoder(tokenizer, self.template_split_tokens)
        self._native = {name: re.search(r"\btools\b", src) is not None for name, src in templates.items()}
        self._reasoning_field = {name: "reasoning_content" in src for name, src in templates.items()}
        self.reasoning = "<think>" in sources or "reasoning_content" in sources or self.family.reasoning is not None
        """The templates know reasoning (``<think>``): chat replies get ``reasoning_content`` split off."""
        # Rendered prompts by their JSON inputs; off for templates that read the clock or a random source.
        self._date_formats = _date_formats(sources)
        """The formats the templates pass to ``strftime_now`` when each writes a date only (gpt-oss's
        ``%Y-%m-%d``): the render cache keys on today's date in them. None when a call writes the time."""
        deterministic = not re.search(r"\b(lipsum|random)\b", sources) and self._date_formats is not None
        self._renders = BoundedLRU(max_entries=4096, max_chars=32 * 1024 * 1024) if deterministic else None
        eos = [tokenizer.token_to_id(t) for t in (special_tokens.get("eos_token"), "<|im_end|>",
                                                   *self.family.stop_tokens) if t]
        ids = [i for i in [*eos, *(extra_eos_ids or [])] if i is not None]
        self._eos_ids = list(dict.fromkeys(ids))

    @classmethod
    def from_dir(cls, path: str | Path, *, tool_role: str = "tool", chat_format: str | None = None
                 ) -> ChatTokenizer:
        """``chat_format``: a family name (``families.FAMILIES``) instead of recognising it; an unrecognised
        tokenizer without one is an ``UnknownChatFormat`` naming what was looked for."""
        d = Path(path).expanduser()
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{d} has no tokenizer.json (a fast tokenizer file is required)")
        config = _read_json(d / "tokenizer_config.json")
        special: dict[str, Any] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            if (tok := _token_content(config.get(key))) is not None:
                special[key] = tok
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens")
        if isinstance(extra, list) and extra:
            special["additional_special_tokens"] = [_token_content(t) for t in extra]
        gen_eos = _read_json(d / "generation_config.json").get("eos_token_id")
        extra_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
        return cls(
            Tokenizer.from_file(str(d / "tokenizer.json")),
            _load_templates(d, config),
            special,
            name_or_path=str(d),
            extra_eos_ids=extra_eos,
            tool_role=tool_role,
            chat_format=chat_format,
        )

    # ---- properties

    @property
    def name_or_path(self) -> str:
        return self._name_or_path

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_ids)

    @property
    def segmented(self) -> bool:
        """True when encoding a rendered text piecewise at ``template_split_tokens`` provably equals encoding
        it whole (``caches.segmentable``)."""
        return self._encoder.pieces

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> set[int]:
        return set(self._special_ids)

    def template_for(self, tools: list | None) -> str:
        """The template name used (``tool_use`` when tools are given and one exists, else ``default``)."""
        if not self.templates:
            raise TemplateRenderError(f"{self._name_or_path or 'this tokenizer'} has no chat template")
        if tools and "tool_use" in self.templates:
            return "tool_use"
        return "default" if "default" in self.templates else next(iter(self.templates))

    def native_tools(self, tools: list | None = None) -> bool:
        """Whether the template renders ``tools`` itself (else they are injected hermes-style)."""
        return self._native[self.template_for(tools)]

    # ---- rendering and tokenizing

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tool_choice: Any = None,
        **kwargs: Any,
    ) -> str:
        if reserved := {"messages", "tools", "documents"} & kwargs.keys():
            raise ValueError(f"template kwargs cannot override {sorted(reserved)}")
        key = render_key(messages, tools, add_generation_prompt, tool_choice, kwargs) if self._renders else None
        if key is not None and self._date_formats:
            now = datetime.now()
            key += "\x00".join(now.strftime(f) for f in self._date_formats).encode()
        if key is not None:
            text = self._renders.get(key)  # type: ignore[union-attr]
            if text is None:
                text = self._render(messages, tools, add_generation_prompt, tool_choice, kwargs)
                self._renders.put(key, text, len(text))  # type: ignore[union-attr]
            return text
        return self._render(messages, tools, add_generation_prompt, tool_choice, kwargs)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool, tool_choice: Any, kwargs: dict[str, Any]) -> str:
        name = self.template_for(tools)
        native = self._native[name]
        prepare = self.family.prepare or prepare_messages
        msgs, visible_tools = prepare(
            messages, tools=tools, tool_choice=tool_choice, native_tools=native, tool_role=self.tool_role,
            reasoning_field=self._reasoning_field[name],
        )
        context = {**self.special_tokens, **kwargs}
        renderer = self._renderers[name]
        try:
            if renderer is not None and (text := renderer.render(msgs, visible_tools, add_generation_prompt,
                                                                 context)) is not None:
                return text
            return self._compiled[name].render(
                messages=msgs,
                tools=visible_tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.exceptions.TemplateError as e:
            raise TemplateRenderError(f"chat template error: {e}") from e
        except (TypeError, KeyError, AttributeError, IndexError) as e:  # a shape the template cannot take
            raise TemplateRenderError(
                f"chat template error ({self.family.name}): {type(e).__name__}: {e}") from e

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are matched, none are added. Exactly
        ``tokenizer.encode(text, add_special_tokens=False).ids``, with repeated pieces cached
        (``caches.SegmentEncoder``)."""
        return self._encoder.encode(text)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """``skip_special_tokens`` skips the special tokens except the family's ``keep_tokens`` (the
        structure of its replies, such as harmony's channels), so reply parsers read them."""
        if skip_special_tokens and self._keep_ids:
            ids = [i for i in ids if i in self._keep_ids or i not in self._special_ids]
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        return self.encode(
            self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        )
