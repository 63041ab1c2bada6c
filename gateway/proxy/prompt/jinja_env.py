"""The jinja2 environment chat templates render in: sandboxed and configured as transformers configures it
(``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``, ``tojson``, ``raise_exception``,
``strftime_now``, a ``namespace`` that refuses underscore attributes, the ``{% generation %}`` tag), so a
template renders here exactly as ``apply_chat_template`` renders it, and made cheaper where that cannot
change what it renders:

- Attribute access on plain values skips the sandbox's per-access checks once they are known: a dict's
  item through ``message.role`` (a name no dict attribute has, where the sandbox's own ``getattr`` fails
  and subscribes), a ``namespace()``'s attribute, and the methods of ``dict``/``list``/``str`` and loop
  attributes, whose safety depends only on the value's type and the name (decided once per pair by the
  sandbox's own ``is_safe_attribute``). ``str.format`` and anything else goes the sandbox's way.
- Calls of builtin methods of plain values (``content.split(...)``), of the globals set here
  (``namespace``, ``raise_exception``, ``strftime_now``) and of macros skip the callable checks the sandbox
  and the context make for other objects (none of these is marked unsafe; a macro takes the eval context,
  the others no context), making the call the context would make.
- Pure macros are memoized: a macro defined at the template's top level whose body reads only its
  arguments, names it sets itself and other pure macros (and ``range``, ``namespace``, ``raise_exception``,
  ``dict``), and changes no namespace it did not make, renders the same text for the same arguments, so
  its text is kept per argument values (compared exactly: types, float spellings and key order included;
  arguments that are not plain JSON-like values are not memoized). gpt-oss's template renders every tool
  signature through such macros on every render.
- ``tojson`` of a dict or a list is memoized the same way (Qwen3's template writes every tool schema through
  it on every render, Llama 3.1's with an ``indent``, which takes Python's pure-Python encoder); a string or
  a number is encoded each time.
"""

from __future__ import annotations

import json
import marshal
import re
import types
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.nodes import EvalContext
from jinja2.runtime import LoopContext, Macro, missing
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import pass_eval_context

from tracegym.gateway.proxy.prompt.caches import BoundedLRU


class _GenerationTag(jinja2.ext.Extension):
    """Accepts transformers' ``{% generation %}...{% endgeneration %}`` markers and renders their body."""

    tags = {"generation"}  # noqa: RUF012 - jinja's API

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes, as transformers' sandbox does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's Namespace signature trick (``self=`` works)
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")

    def __setitem__(self, name: str, value: Any) -> None:
        TemplateNamespace._check(name)
        super().__setitem__(name, value)


# ---------------------------------------------------------------------------------------- exact memo keys


class _Unkeyable(Exception):
    """A value that is not plain JSON-like data: its calls are not memoized."""


def memo_key(value: Any) -> bytes:
    """A key equal for two values exactly when they are the same plain data: ``marshal`` (format 2, which
    writes no back-references) accepts only the exact builtin types and writes each type apart (``1``,
    ``1.0`` and ``True`` differ, as do a list and a tuple), floats bit for bit (``-0.0``, ``nan``) and dicts in
    their key order (templates iterate it); equal bytes load back as equal values. ``_Unkeyable`` for
    anything else (a ``Markup``, an undefined value, a namespace)."""
    try:
        return marshal.dumps(value, 2)
    except ValueError:  # unmarshallable (also: nested too deeply)
        raise _Unkeyable from None


# ---------------------------------------------------------------------------------------------- pure macros

_CONSTANT_GLOBALS = frozenset({"range", "dict", "namespace", "raise_exception", "cycler", "joiner"})
"""Globals a memoized macro may read: functions of their arguments only (``strftime_now`` and ``lipsum``
are not, so a macro reading them is never memoized)."""
_IMPURE_FILTERS = frozenset({"random"})
_MACRO_LINE = re.compile(
    r"^    (?:context\.vars\['\w+'\] = )?l_0_(\w+) = Macro\(environment, macro, '(\w+)', \((.*?)\), "
    r"(True|False), (True|False), (True|False), context\.eval_ctx\.autoescape\)$", re.MULTILINE)


def memoize_macros(code: str) -> tuple[str, frozenset[str]]:
    """The Python jinja generated for a template, with its memoizable top-level macros created by
    ``TemplateEnvironment.memo_macro`` (which keeps their text per arguments and per value of every
    context name they read), and their names. A macro is memoizable when its code reads no template
    variable but other memoizable macros (``l_0_*``), uses no ``caller``, sets no namespace attribute (the
    namespace may be the caller's), and applies no impure filter; the context names it reads (``resolve``)
    go into the key."""
    impure = {m.group(1) for m in re.finditer(r"^    (t_\d+) = environment\.filters\['(\w+)'\]$", code,
                                              re.MULTILINE) if m.group(2) in _IMPURE_FILTERS}
    found: dict[str, tuple[re.Match[str], set[str], tuple[str, ...]]] = {}
    for m in _MACRO_LINE.finditer(code):
        var, name, _, _, _, caller = m.groups()
        start = code.rfind("\n    def macro(", 0, m.start())
        body = code[start : m.start()]
        if var != name or caller == "True" or "Namespace" in body or any(re.search(rf"\b{t}\b", body) for t in impure):
            continue
        binds = [line for line in re.findall(rf"^.*\bl_0_{name} = .*$", code, re.MULTILINE)
                 if not line.endswith(" = missing")]  # (the template's variables start out missing)
        if len(binds) != 1:  # rebound elsewhere in the template
            continue
        reads = set(re.findall(r"\bl_0_(\w+)", body))
        resolved = tuple(sorted(set(re.findall(r"\bresolve\('(\w+)'\)", body))))
        found[name] = (m, reads, resolved)
    changed = True
    while changed:  # a macro reading a template variable that is no memoizable macro is not memoizable
        changed = False
        for name, (_, reads, _) in list(found.items()):
            if not reads <= found.keys():
                del found[name]
                changed = True
    for m, _, resolved in sorted(found.values(), key=lambda f: -f[0].start()):  # from the end: offsets hold
        line = m.group(0).replace("Macro(environment,", f"environment.memo_macro(context, {resolved!r}, environment,", 1)
        code = code[: m.start()] + line + code[m.end():]
    return code, frozenset(found)


class MemoMacro(Macro):
    """A memoizable macro (``memoize_macros``): its text kept per argument values and per value of the
    context names it reads."""

    def __init__(self, context: Any, resolved: tuple[str, ...], *args: Any) -> None:
        super().__init__(*args)
        self._context, self._resolved = context, resolved

    def _reads(self) -> tuple[Any, ...]:
        out = []
        env = self._environment
        for name in self._resolved:
            value = self._context.resolve_or_missing(name)
            if value is missing:
                out.append(("missing",))
            elif name in _CONSTANT_GLOBALS and value is env.globals.get(name):
                out.append(("global", name))
            else:
                out.append(memo_key(value))
        return tuple(out)

    @pass_eval_context
    def __call__(self, *args: Any, **kwargs: Any) -> str:
        env = self._environment
        ctx = args[0] if args and isinstance(args[0], EvalContext) else None
        try:
            key = (self.name, ctx.autoescape if ctx else self._default_autoescape,
                   memo_key(args[1:] if ctx else args), memo_key(kwargs), self._reads())
        except _Unkeyable:
            return super().__call__(*args, **kwargs)
        text = env.memo.get(key)  # type: ignore[attr-defined]
        if text is None:
            text = super().__call__(*args, **kwargs)
            if type(text) is str:
                env.memo.put(key, text, len(text))  # type: ignore[attr-defined]
        return text


# ------------------------------------------------------------------------------------------ the environment

_DICT_ATTRIBUTES = frozenset(dir(dict))
_LOOP_ATTRIBUTES = frozenset({"index", "index0", "revindex", "revindex0", "first", "last", "length", "depth",
                              "depth0", "previtem", "nextitem"})
"""Attributes every ``LoopContext`` has (which the sandbox lets a template read: no underscore)."""
_TEMP = "tracegym_read"
"""The generated code's name for a value whose item it reads (jinja's own names are ``l_*``, ``t_*``)."""
_METHOD_TYPES = frozenset({types.MethodType, types.BuiltinMethodType})
"""The values ``wrap_str_format`` may wrap (``str.format`` and ``str.format_map``, bound)."""


def _namespace_attrs(ns: TemplateNamespace) -> dict[str, Any]:
    """What ``Namespace.__getattribute__`` reads from."""
    return object.__getattribute__(ns, "_Namespace__attrs")
_FAST_TYPES = frozenset({dict, list, str, tuple, int, float, bool, LoopContext})
_PLAIN_SELF = frozenset({dict, list, str, tuple, int, float, bool})


class _CodeGenerator(CodeGenerator):
    """Jinja's code, with a dict's item read in place where the sandbox would read it anyway:
    ``message.role`` (a name no dict attribute has) and ``message["role"]`` on a dict that has the key are
    ``message["role"]`` without a call into the environment; any other value, or a missing key, goes
    through ``environment.getattr``/``getitem`` as jinja writes it."""

    @optimizeconst
    def visit_Getattr(self, node: nodes.Getattr, frame: Frame) -> None:
        if self.environment.is_async or node.attr in _DICT_ATTRIBUTES:
            return CodeGenerator.visit_Getattr(self, node, frame)
        self._dict_read(node.node, repr(node.attr), "getattr", frame)
        return None

    @optimizeconst
    def visit_Getitem(self, node: nodes.Getitem, frame: Frame) -> None:
        if (self.environment.is_async or not isinstance(node.arg, nodes.Const)
                or type(node.arg.value) is not str):
            return CodeGenerator.visit_Getitem(self, node, frame)
        self._dict_read(node.node, repr(node.arg.value), "getitem", frame)
        return None

    def _dict_read(self, obj: nodes.Node, key: str, method: str, frame: Frame) -> None:
        self.write(f"({_TEMP}[{key}] if type({_TEMP} := ")  # the condition runs first: obj is read once
        self.visit(obj, frame)
        self.write(f") is dict and {key} in {_TEMP} else ")
        if method == "getattr" and key[1:-1] in _LOOP_ATTRIBUTES:  # ``loop.index0``: a property, safe by name
            self.write(f"{_TEMP}.{key[1:-1]} if type({_TEMP}) is LoopContext else ")
        self.write(f"environment.{method}({_TEMP}, {key}))")


class TemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the shortcuts and memos of the module docstring; one per compiled template."""

    code_generator_class = _CodeGenerator

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.memoized: frozenset[str] = frozenset()
        """The template's memoized macros (``memoize_macros``)."""
        self.memo = BoundedLRU(max_entries=1024, max_chars=8 * 1024 * 1024)
        self._safe: dict[tuple[type, str], bool] = {}
        self._encode = json.JSONEncoder(ensure_ascii=False).encode

    def memo_macro(self, context: Any, resolved: tuple[str, ...], *args: Any) -> MemoMacro:
        """Called by the generated code of a memoizable macro instead of ``Macro(...)``."""
        return MemoMacro(context, resolved, *args)

    def getattr(self, obj: Any, attribute: str) -> Any:
        t = type(obj)
        if t is dict and attribute not in _DICT_ATTRIBUTES:  # what the sandbox ends with: obj[attribute]
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        if t is TemplateNamespace and not attribute.startswith("_"):  # safe by name; str.format still wrapped
            value = _namespace_attrs(obj).get(attribute, missing)
            if value is missing:
                return self.undefined(obj=obj, name=attribute)
            if type(value) in _METHOD_TYPES:
                fmt = self.wrap_str_format(value)
                return value if fmt is None else fmt
            return value
        if t in _FAST_TYPES:
            try:
                value = getattr(obj, attribute)
            except AttributeError:
                return super().getattr(obj, attribute)
            safe = self._safe.get((t, attribute))
            if safe is None:
                safe = attribute not in ("format", "format_map") and self.is_safe_attribute(obj, attribute, value)
                self._safe[(t, attribute)] = safe
            if safe:
                return value
            fmt = self.wrap_str_format(value)
            if fmt is not None:
                return fmt
            return value if self.is_safe_attribute(obj, attribute, value) else self.unsafe_undefined(obj, attribute)
        return super().getattr(obj, attribute)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        t = type(__obj)
        if t is Macro or t is MemoMacro:  # what the context does: its ``__call__`` takes the eval context
            args = (__context.eval_ctx, *args)
        elif not (__obj is TemplateNamespace or __obj is _raise_exception or __obj is _strftime_now or (
                t is types.BuiltinMethodType and type(__obj.__self__) in _PLAIN_SELF
                and __obj.__name__ not in ("format", "format_map"))):
            return super().call(__context, __obj, *args, **kwargs)
        kwargs.pop("_block_vars", None)
        kwargs.pop("_loop_vars", None)
        try:
            return __obj(*args, **kwargs)
        except StopIteration:
            return __context.environment.undefined(
                "value was undefined because a callable raised a StopIteration exception")

    def tojson(self, x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        plain = indent is None and not ensure_ascii and separators is None and not sort_keys
        if indent is None and type(x) is not dict and type(x) is not list:  # encoding costs less than a key
            return self._encode(x) if plain else _tojson(x, ensure_ascii, indent, separators, sort_keys)
        try:
            key = ("tojson", memo_key(x), ensure_ascii, memo_key(indent), memo_key(separators), sort_keys)
        except _Unkeyable:
            key = None
        text = self.memo.get(key) if key is not None else None
        if text is None:  # (``_encode``: what json.dumps does, without making an encoder per call)
            text = self._encode(x) if plain else _tojson(x, ensure_ascii, indent, separators, sort_keys)
            if key is not None:
                self.memo.put(key, text, len(text))
        return text


def compile_template(source: str) -> jinja2.Template:
    env = TemplateEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = env.tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = TemplateNamespace
    code, env.memoized = memoize_macros(env.compile(source, raw=True))
    template = env.template_class.from_code(env, compile(code, "<template>", "exec"), env.make_globals(None), None)
    template.globals = dict(template.globals)  # a ChainMap over env.globals, copied key by key per render
    return template
