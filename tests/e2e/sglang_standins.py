"""Stand-ins for SGLang's GPU-only imports (``triton``, ``torchvision``), so that SGLang 0.5.23's own
request classes import on a CPU machine (``scripts/sglang_layer.sh``). They only satisfy imports: any
attribute is a do-nothing object (a decorator passes its function through, a CamelCase name is an empty
class); no SGLang class is replaced. torch and transformers decide whether triton/torchvision exist when
first asked, so those checks run before the stand-ins become visible (torch would otherwise take the
stand-in for a real triton and build its Inductor backend on it)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

GPU_ONLY = ("triton", "torchvision")


class _Anything:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value: Any = type(name, (), {"__module__": self.__name__}) if name[:1].isupper() else _Anything()
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install(roots: tuple[str, ...] = GPU_ONLY) -> None:
    """Stand in for those of ``roots`` that are not installed (an installed one is used as it is)."""
    roots = tuple(r for r in roots if importlib.util.find_spec(r) is None)
    if not roots:
        return
    import torch._dynamo
    import torch._inductor.compile_fx
    import torch.utils.flop_counter  # noqa: F401
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    sys.meta_path.insert(0, _Finder(roots))
