"""SGLang 0.5.23's own code judging request bodies (run as a subprocess by test_sglang_classes.py, with
``scripts/sglang_layer.sh``'s layer on PYTHONPATH). Reads ``{"tokenizer_dir", "vocab_size", "calls":
[{"path", "body"}]}`` on stdin, writes ``[{"path", "cls", "problems": [...]}]`` on stdout.

For each call it does what SGLang's HTTP server does with the body, with SGLang's classes unmodified:
the route's request class is read from the route's signature in ``srt/entrypoints/http_server.py``;
FastAPI's validation of it (``pydantic.TypeAdapter(cls)``); the class built from the body
(``cls(**body)``, stricter than FastAPI: an unknown key is a problem here, SGLang would ignore it). For
``/generate`` also: the 0.5.23 JSON contract (``generate_contract_error``: HTTP 400 in the server),
``GenerateReqInput.normalize_batch_and_arguments()``, and per (sub-)request what the tokenizer manager
does with ``sampling_params`` (``SamplingParams(**sp)``, ``.normalize(tokenizer)``,
``.verify(vocab_size)``). ``"finish_reasons"`` (optional): response finish reasons, each compared
with what SGLang's own ``FINISH_*`` class of its kind serialises to."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any


def route_classes(http_server: Path) -> dict[str, str | None]:
    """path → the name of the request class its handler takes as body (None: it reads no body)."""
    out: dict[str, str | None] = {}
    for node in ast.walk(ast.parse(http_server.read_text())):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        paths = [d.args[0].value for d in node.decorator_list
                 if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                 and d.func.attr in ("post", "get", "api_route") and d.args
                 and isinstance(d.args[0], ast.Constant)]
        cls = None
        for arg in node.args.args:
            ann = arg.annotation
            if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated":
                ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
            if isinstance(ann, ast.Name) and ann.id.endswith(("ReqInput", "Req", "ReqInput")):
                cls = ann.id
        for p in paths:
            out[p] = cls
    return out


def judge(call: dict[str, Any], classes: dict[str, str | None], tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    import pydantic
    from sglang.srt.managers import io_struct
    from sglang.srt.sampling.sampling_params import SamplingParams

    path, body = call["path"], call["body"]
    problems: list[str] = []
    if path not in classes:
        return {"path": path, "cls": None, "problems": [f"SGLang 0.5.23 has no route {path}"]}
    name = classes[path]
    if name is None:
        if body:
            problems.append(f"{path} reads no JSON body; the body {body} is ignored")
        return {"path": path, "cls": None, "problems": problems}
    cls = getattr(io_struct, name)
    try:
        pydantic.TypeAdapter(cls).validate_python(body)
    except pydantic.ValidationError as e:
        problems.append(f"FastAPI would answer 422: {e}")
    try:
        obj = cls(**body)
    except TypeError as e:
        return {"path": path, "cls": name, "problems": [*problems, f"{name}(**body): {e}"]}
    if path == "/update_weights_from_distributed":
        problems += _receivable(obj)
    if path == "/generate":
        from sglang.srt.entrypoints.api_contract import generate_contract_error

        err = generate_contract_error(json.loads(json.dumps(body)))
        if err is not None:
            problems.append(f"contract (HTTP 400): {err}")
        try:
            obj.normalize_batch_and_arguments()
            subs = [obj] if obj.is_single else [obj[i] for i in range(len(obj.rid))]
            for sub in subs:
                sp = SamplingParams(**sub.sampling_params)
                sp.normalize(tokenizer)
                sp.verify(vocab_size)
        except (ValueError, TypeError, AssertionError) as e:
            problems.append(f"{type(e).__name__}: {e}")
    return {"path": path, "cls": name, "problems": problems}


def _receivable(obj: Any) -> list[str]:
    """What SGLang's receiving side does with the bucket (``model_runner_components/weight_updater.py``
    ``receive_weights_from_distributed``: ``zip(names, dtypes, shapes)``, ``torch.empty(shape,
    dtype=getattr(torch, dtype))``), where a length mismatch would silently drop tensors."""
    import torch

    if not len(obj.names) == len(obj.dtypes) == len(obj.shapes):
        return [f"names/dtypes/shapes lengths differ: {len(obj.names)}/{len(obj.dtypes)}/{len(obj.shapes)}"]
    problems = []
    for dtype, shape in zip(obj.dtypes, obj.shapes, strict=True):
        target = getattr(torch, dtype, None)
        if not isinstance(target, torch.dtype):
            problems.append(f"dtype {dtype!r} is not a torch dtype name")
        else:
            torch.empty(shape, dtype=target)
    return problems


def judge_finish_reason(fr: dict[str, Any]) -> list[str]:
    """``fr`` is what SGLang's own finish-reason class of its kind serialises to (``schedule_batch.py``)."""
    from sglang.srt.managers import schedule_batch as sb

    kinds = {"length": lambda: sb.FINISH_LENGTH(length=fr["length"]),
             "stop": lambda: (sb.FINISH_MATCHED_STR if isinstance(fr.get("matched"), str)
                              else sb.FINISH_MATCHED_TOKEN)(matched=fr["matched"]),
             "abort": lambda: sb.FINISH_ABORT(fr.get("message"), fr.get("status_code"), fr.get("err_type"))}
    if fr.get("type") not in kinds:
        return [f"SGLang has no finish reason of type {fr.get('type')!r}"]
    try:
        want = kinds[fr["type"]]().to_json()
    except KeyError as e:
        return [f"{fr} lacks {e}"]
    return [] if want == fr else [f"{fr} != SGLang's {want}"]


def main() -> None:
    import tests.e2e.sglang_standins as standins

    standins.install()
    req = json.load(sys.stdin)
    import sglang
    from transformers import AutoTokenizer

    classes = route_classes(Path(sglang.__file__).parent / "srt" / "entrypoints" / "http_server.py")
    tokenizer = AutoTokenizer.from_pretrained(req["tokenizer_dir"])
    verdicts = [judge(c, classes, tokenizer, req["vocab_size"]) for c in req["calls"]]
    verdicts += [{"path": "finish_reason", "cls": fr.get("type"), "problems": judge_finish_reason(fr)}
                 for fr in req.get("finish_reasons", [])]
    json.dump(verdicts, sys.stdout)


if __name__ == "__main__":
    main()
