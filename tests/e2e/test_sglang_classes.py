"""SGLang 0.5.23's own code as the judge of our SGLang adapter.

Requests: the real gateway (in front of the recording SGLang fake) and the trainer's weight sync make
every kind of call they make to SGLang — chat with every sampling option the adapter maps, n > 1, a
stream cut short (``/abort_request``), a disk swap that cuts a call short (and its continuation), a
distributed group init and update — and the
bodies the fake received are judged in a subprocess by SGLang's unmodified request classes
(``tests/e2e/sglang_judge.py``, over ``scripts/sglang_layer.sh``'s layer).

Responses: the embedded engine's ``/generate`` (non-stream, stream, n > 1, top logprobs) and
``/model_info`` carry every field SGLang's server returns; those field names are read from SGLang's
source in the layer (``tokenizer_manager.py``, ``http_server.py``), not copied by hand.

Slow: the layer's first install downloads ~70 MB (cached afterwards), and importing SGLang takes ~10 s."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.app_support import SWAP_REPLY, recorded_gateway, start_fake
from tests.procs import ManagedProcess, free_port, start_process
from tracegym.gateway.proxy.upstream.base import GenerateRequest, SamplingParams
from tracegym.gateway.proxy.upstream.sglang import generate_payload
from tracegym.trainer.weights.distributed import DistributedWeightSync

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-random"
ROUTES = {"/generate", "/abort_request", "/pause_generation", "/update_weights_from_disk",
          "/continue_generation", "/init_weights_update_group", "/flush_cache", "/begin_weight_update",
          "/update_weights_from_distributed", "/end_weight_update"}
"""Every SGLang route the gateway calls with a body (the test fails if one of them was not exercised)."""


@pytest.fixture(scope="module")
def layer() -> Path:
    out = subprocess.run(["bash", str(REPO / "scripts" / "sglang_layer.sh")], capture_output=True, text=True,
                         timeout=900, check=False)
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip().splitlines()[-1])


def run_judge(layer: Path, tokenizer_dir: Path, calls: list[dict[str, Any]],
              finish_reasons: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    req = {"tokenizer_dir": str(tokenizer_dir), "vocab_size": vocab, "calls": calls,
           "finish_reasons": finish_reasons or []}
    out = subprocess.run(
        [sys.executable, "-m", "tests.e2e.sglang_judge"], cwd=REPO, capture_output=True, text=True, timeout=600,
        input=json.dumps(req),
        env={**_env(), "PYTHONPATH": f"{REPO}:{layer}"}, check=False,
    )
    assert out.returncode == 0, out.stderr[-5000:]
    return json.loads(out.stdout)


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# ------------------------------------------------------------------------------------------ requests


@pytest.fixture(scope="module")
def sent(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every body the gateway and the weight sync sent to the (fake) SGLang, as ``{"path", "body"}``."""
    tmp = tmp_path_factory.mktemp("sglang-judge")
    with start_fake(tmp, "--token-delay", "0.02", tokenizer=tiny_model_dir, reply=SWAP_REPLY) as fake, \
            recorded_gateway(fake.base_url, tmp, MODEL) as (srv, _):
        _drive(srv.url, fake, tmp)
        debug = httpx.get(fake.base_url + "/debug").json()
    return ([{"path": "/generate", "body": b} for b in debug["requests"]] + debug["controls"]
            + [{"path": "/abort_request", "body": b} for b in debug["abort_bodies"]])


def _drive(url: str, fake: ManagedProcess, tmp: Path) -> None:
    msgs = [{"role": "user", "content": "add 2 and 3"}]
    chat = {"model": MODEL, "messages": msgs, "max_tokens": 6, "temperature": 0.7, "top_p": 0.9, "seed": 3,
            "stop": ["5."], "frequency_penalty": 0.1, "presence_penalty": 0.2, "logprobs": True,
            "top_logprobs": 2}
    for body in (chat, {"model": MODEL, "messages": msgs, "n": 2, "max_tokens": 4},
                 {"model": MODEL, "messages": msgs, "temperature": 0}):
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())  # the client goes away mid-stream: the adapter aborts the generation
    out: dict[str, httpx.Response] = {}
    cut = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
        url + "/v1/chat/completions", json={**chat, "max_tokens": 40, "stop": None}, timeout=60)))
    cut.start()  # a disk swap pauses it mid-generation: the adapter re-posts the rest (a continuation)
    time.sleep(0.3)
    r = httpx.post(url + "/api/weights/update", json={"model_path": str(tmp), "weight_version": "v1"}, timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    cut.join(60)
    assert out["r"].status_code == 200, out["r"].text
    sync = DistributedWeightSync(url, backend="gloo", broadcast_dtype="float32", bucket_bytes=64, timeout_s=60)
    sync.init_group("127.0.0.1", free_port(), 2, join=lambda: None)
    specs = [("model.a", [4, 4]), ("model.b", [8])]

    def broadcast(tensors: list[Any]) -> None:  # the fake's stand-in for the receiving side
        names = [n for n, s in specs if list(s) in [list(t.shape) for t in tensors]]
        threading.Thread(target=lambda: httpx.post(fake.base_url + "/debug/broadcast", json={"names": names}),
                         daemon=True).start()

    import torch

    result = sync.push(specs, iter([(n, torch.zeros(s)) for n, s in specs]), "v2", broadcast)
    assert result.version == "v2"
    deadline = time.monotonic() + 10
    while not httpx.get(fake.base_url + "/debug").json()["abort_bodies"]:
        assert time.monotonic() < deadline, "the cut stream was never aborted upstream"
        time.sleep(0.05)


def test_every_request_parses_and_validates_with_sglangs_classes(layer: Path, tiny_model_dir: Path,
                                                                 sent: list[dict[str, Any]]) -> None:
    assert {c["path"] for c in sent} == ROUTES
    assert any(c["body"].get("rid", "").endswith("-c1") for c in sent if c["path"] == "/generate"), \
        "no continuation was posted"
    verdicts = run_judge(layer, tiny_model_dir, sent)
    bad = [v for v in verdicts if v["problems"]]
    assert not bad, json.dumps(bad, indent=1)[:6000]
    judged = {v["path"]: v["cls"] for v in verdicts}
    assert {p for p, cls in judged.items() if cls is None} == {"/flush_cache"}  # the one route without a body
    assert judged["/generate"] == "GenerateReqInput"
    assert judged["/update_weights_from_distributed"] == "UpdateWeightsFromDistributedReqInput"


def test_the_judge_rejects_what_sglang_rejects(layer: Path, tiny_model_dir: Path) -> None:
    """The judge is not vacuous: bodies SGLang refuses are refused here too."""
    bad = [
        {"path": "/generate", "body": {"input_ids": [1, 2], "sampling_params": {"max_tokens": 4}}},
        {"path": "/generate", "body": {"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}}},
        {"path": "/generate", "body": {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}},
        {"path": "/update_weights_from_disk", "body": {"weight_version": "v1"}},
        {"path": "/update_weights_from_distributed", "body": {"names": ["a"], "dtypes": ["bfloat16"],
                                                              "shapes": [[2]], "flush": False}},
        {"path": "/weight_version", "body": {}},
        {"path": "/update_weights_from_distributed", "body": {"names": ["a", "b"], "dtypes": ["bf16", "float32"],
                                                              "shapes": [[2], [3]]}},
    ]
    bad_reasons = [{"type": "abort", "message": "engine error", "status_code": 500}, {"type": "length"},
                   {"type": "eos"}]
    verdicts = run_judge(layer, tiny_model_dir, bad, bad_reasons)
    assert [bool(v["problems"]) for v in verdicts] == [True] * 10, json.dumps(verdicts, indent=1)


# ----------------------------------------------------------------------------------------- responses


def _dict_keys(node: ast.AST) -> set[str]:
    return {k.value for k in getattr(node, "keys", []) if isinstance(k, ast.Constant)}


def sglang_fields(layer: Path) -> dict[str, set[str]]:
    """The keys SGLang 0.5.23 puts into every ``/generate`` response object (``top``), its ``meta_info``
    (``meta``; ``logprob_meta`` more with ``return_logprob``, ``top_meta`` with ``top_logprobs_num``) and ``/model_info`` (``model_info``): the
    dict literals of ``_handle_batch_output``/``convert_logprob_style`` in ``tokenizer_manager.py`` and
    of ``model_info`` in ``http_server.py``."""
    srt = layer / "sglang" / "srt"
    tm = ast.parse((srt / "managers" / "tokenizer_manager.py").read_text())
    funcs = {f.name: f for f in ast.walk(tm) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
    meta: set[str] = set()
    top: set[str] = set()  # what every text-generation out_dict has (not --skip-tokenizer-init's)
    for node in ast.walk(funcs["_handle_batch_output"]):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id == "meta_info":
                meta |= _dict_keys(node.value)
            if isinstance(target, ast.Name) and target.id == "out_dict" and "text" in _dict_keys(node.value):
                top = top & _dict_keys(node.value) if top else _dict_keys(node.value)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "meta_info"
                and node.args and isinstance(node.args[0], ast.Dict)):
            meta |= _dict_keys(node.args[0])
    add = funcs["add_logprob_to_meta_info"]
    logprob_meta = {t.slice.value for node in add.body if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)}
    anywhere = {t.slice.value for node in ast.walk(add) if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)}
    top_meta = anywhere & {"output_top_logprobs", "input_top_logprobs"}  # set when top_logprobs_num > 0
    hs = ast.parse((srt / "entrypoints" / "http_server.py").read_text())
    info = next(f for f in ast.walk(hs) if isinstance(f, ast.AsyncFunctionDef) and f.name == "model_info")
    model_info = next(_dict_keys(n.value) for n in ast.walk(info) if isinstance(n, ast.Assign)
                      and isinstance(n.value, ast.Dict))
    return {"top": top, "meta": meta, "logprob_meta": logprob_meta, "top_meta": top_meta, "model_info": model_info}


def test_sglang_fields_read_from_source(layer: Path) -> None:
    f = sglang_fields(layer)
    # what SGLANG.md §1/§3 lists, as a check that the source reading found the right dicts
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version"} <= f["meta"]
    assert {"output_token_logprobs", "input_token_logprobs"} <= f["logprob_meta"]
    assert f["top_meta"] == {"output_top_logprobs", "input_top_logprobs"}
    assert f["top"] == {"text", "output_ids", "meta_info"}
    assert {"model_path", "served_model_name", "tokenizer_path", "weight_version"} <= f["model_info"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    port = free_port()
    log = tmp_path_factory.mktemp("judge-engine") / "engine.log"
    with start_process(["tracegym", "engine", "--model", MODEL, "--port", str(port)], port=port, log_path=log,
                       timeout=240) as p:
        yield p


def _payload(*, stream: bool, n: int = 1, top: int = 0) -> dict[str, Any]:
    req = GenerateRequest(input_ids=[1, 2, 3, 4], rid=f"judge-{stream}-{n}" + ("-top" if top else ""), operation="chat", top_logprobs=top,
                          sampling=SamplingParams(max_tokens=4, temperature=0.8, n=n))
    return generate_payload(req, stream=stream)


def _stopped(engine: ManagedProcess) -> dict[str, Any]:
    """A generation that ends on a stop token (greedy: the first token of a first run)."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    first = httpx.post(engine.base_url + "/generate", json=body, timeout=60).json()["output_ids"][0]
    body["sampling_params"]["stop_token_ids"] = [first]
    return httpx.post(engine.base_url + "/generate", json=body, timeout=60).json()["meta_info"]["finish_reason"]


def _aborted(engine: ManagedProcess) -> dict[str, Any]:
    """A stream cut by ``/abort_request``: its last chunk's finish reason."""
    body = {"input_ids": [5, 6, 7], "rid": "judge-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 100000, "ignore_eos": True}}
    last: dict[str, Any] = {}
    with httpx.stream("POST", engine.base_url + "/generate", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                if not last:
                    httpx.post(engine.base_url + "/abort_request", json={"rid": "judge-abort"}, timeout=30)
                last = json.loads(line[6:])
    return last["meta_info"]["finish_reason"]


def test_embedded_engine_answers_with_sglangs_fields(layer: Path, engine: ManagedProcess,
                                                     tiny_model_dir: Path) -> None:
    f = sglang_fields(layer)
    items: list[dict[str, Any]] = []
    for n, top in ((1, 0), (2, 2)):
        r = httpx.post(engine.base_url + "/generate", json=_payload(stream=False, n=n, top=top), timeout=60)
        assert r.status_code == 200, r.text
        items += r.json() if n > 1 else [r.json()]
    with httpx.stream("POST", engine.base_url + "/generate", json=_payload(stream=True, top=2), timeout=60) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert chunks
    for item in items + chunks:
        assert f["top"] <= set(item), f["top"] - set(item)
        meta = item["meta_info"]
        missing = (f["meta"] | f["logprob_meta"] | (f["top_meta"] if "top" in str(meta["id"]) else set())) - set(meta)
        if meta["finish_reason"] is None:
            missing -= {"e2e_latency"}  # SGLang sets it on the final object only
        assert not missing, f"meta_info lacks SGLang's {sorted(missing)}"
    reasons = [it["meta_info"]["finish_reason"] for it in items + chunks if it["meta_info"]["finish_reason"]]
    reasons += [_stopped(engine), _aborted(engine)]
    assert {r["type"] for r in reasons} == {"length", "stop", "abort"}
    verdicts = run_judge(layer, tiny_model_dir, [], reasons)
    assert not [v for v in verdicts if v["problems"]], verdicts
    info = httpx.get(engine.base_url + "/model_info", timeout=30).json()
    assert f["model_info"] <= set(info), f"/model_info lacks SGLang's {sorted(f['model_info'] - set(info))}"
