"""A tiny SGLang fake (aiohttp): ``/generate`` answers a fixed reply with zero latency, plus
``/model_info``, ``/health``, ``/abort_request``. For the gateway benchmark and gateway tests.

    python -m benchmarks.fake_sglang --port 30001 [--tokenizer DIR --reply TEXT] [--delay 5]

With ``--tokenizer``, the reply's ids are ``encode(reply) + [eos]`` (so the gateway decodes the reply
back); without it, the ids are fixed small integers. ``--reply-when KEY=TEXT`` (repeatable, needs
``--tokenizer``) answers TEXT instead when the decoded prompt contains KEY (the key found last in the
prompt wins), so one fake can play several replies. Honours ``max_new_tokens`` (finish ``length``),
``n`` (list response) and ``stream`` (SGLang's cumulative chunks, one token per chunk). ``--delay``
sleeps before answering (timeouts); ``--stream-delay`` sleeps between stream chunks (disconnects);
``--one-write`` sends a stream's chunks in one write.

Weight swaps: ``/pause_generation`` (mode abort: requests in flight answer at once with their partial
output and finish_reason abort, new ones are held until ``/continue_generation``),
``/update_weights_from_disk`` (an existing directory succeeds and sets the served ``weight_version``;
anything else answers 400 ``success: false``). ``--token-delay`` makes each generated token take that
long (stream and non-stream), so a pause can land mid-generation.

Distributed weight updates (SGLang ≥ 0.5.23's routes; ``--no-weight-session`` drops
``/begin_weight_update``/``/end_weight_update`` like older servers): ``/init_weights_update_group``
succeeds at once, ``/flush_cache`` fails while generations run unpaused, and
``/update_weights_from_distributed`` refuses outside a begin…end session, then waits (10 s at most) for
the test's stand-in of the trainer's broadcast, ``POST /debug/broadcast {"names"}``, as SGLang returns
only after receiving. A bucket with a name containing ``fail`` is refused after it was received, and so is
one whose broadcast names differ from the body's. ``--staged`` applies a session's version only at its
end and honours ``{"discard": true}`` there, as the embedded engine does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import orjson
from aiohttp import web

KNOWN_SAMPLING = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "n",
    "sampling_seed", "frequency_penalty", "presence_penalty", "ignore_eos", "skip_special_tokens",
    "no_stop_trim",
}


DISTRIBUTED = ("/init_weights_update_group", "/flush_cache", "/update_weights_from_distributed",
               "/begin_weight_update", "/end_weight_update")


class Fake:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.requests: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        if args.tokenizer:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(f"{args.tokenizer}/tokenizer.json")
            eos = tok.token_to_id(args.eos)
            if eos is None:
                raise SystemExit(f"--eos {args.eos!r} is not a token of {args.tokenizer}")
            self.tok = tok

            def reply(text: str) -> tuple[list[int], list[str]]:
                ids = [*tok.encode(text, add_special_tokens=False).ids, eos]
                return ids, [tok.decode([i]) for i in ids]

            self.ids, self.texts = reply(args.reply)
            self.keyed = {key: reply(text) for key, _, text in (kv.partition("=") for kv in args.reply_when)}
            self.eos = eos
        else:
            self.ids = list(range(100, 100 + args.tokens))
            self.texts = [f"t{i}" for i in self.ids]
            self.eos = None
            if args.reply_when:
                raise SystemExit("--reply-when needs --tokenizer")
            self.keyed = {}
        self.reply = args.reply
        self.version = args.weight_version
        self.cannot_read: list[str] = list(getattr(args, "cannot_read", []))
        self.controls: list[dict[str, Any]] = []
        self.abort_bodies: list[dict[str, Any]] = []
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.pauses = 0  # bumped by each pause: generations started before it abort
        self.cut: set[str] = set()  # rids /abort_request ended (slow generations stop at their next token)
        self.inflight = 0
        self.broadcasts: asyncio.Queue[list[str]] = asyncio.Queue()
        self.in_session = False
        self.staged_version: str | None = None
        """With ``--staged``: the version a session's buckets carry, applied at its end unless discarded."""

    def reply_for(self, input_ids: list[int]) -> tuple[list[int], list[str]]:
        """``(ids, token texts)`` of the reply to this prompt (``--reply-when``, else ``--reply``)."""
        if not self.keyed:
            return self.ids, self.texts
        prompt = self.tok.decode(input_ids, skip_special_tokens=False)
        at, key = max((prompt.rfind(k), k) for k in self.keyed)
        return self.keyed[key] if at >= 0 else (self.ids, self.texts)

    def plan(self, max_new: int | None, stops: list[str], reply: tuple[list[int], list[str]]) -> tuple[int, dict]:
        """How many reply tokens to send and the final finish_reason (length / stop string / eos)."""
        ids, texts = reply
        for k in range(1, len(ids) + 1):
            text = "".join(texts[:k])
            hit = next((s for s in stops if s in text), None)
            if max_new is not None and k > max_new:
                return max_new, {"type": "length", "length": max_new}
            if hit is not None:
                return k, {"type": "stop", "matched": hit}
        if max_new is not None and max_new < len(ids):
            return max_new, {"type": "length", "length": max_new}
        return len(ids), {"type": "stop", "matched": self.eos if self.eos is not None else "</s>"}

    def item(self, rid: str, prompt_len: int, n_tokens: int, index: int, total: int, fr: dict,
             reply: tuple[list[int], list[str]] | None = None) -> dict:
        all_ids, texts = reply or (self.ids, self.texts)
        ids = all_ids[:n_tokens]
        meta = {
            "id": rid, "finish_reason": fr if n_tokens >= total else None, "prompt_tokens": prompt_len,
            "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": self.version,
            "output_token_logprobs": [[-0.5 - 0.01 * k, t, None] for k, t in enumerate(ids)],
        }
        return {"text": "".join(texts[: len(ids)]), "output_ids": ids, "meta_info": meta, "index": index}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if self.args.record:
            self.requests.append(body)
        bad = set(body.get("sampling_params", {})) - KNOWN_SAMPLING
        if bad:
            return web.json_response({"error": {"message": f"unknown sampling params {sorted(bad)}"}}, status=400)
        if "input_ids" not in body:
            return web.json_response({"error": {"message": "input_ids required"}}, status=400)
        if self.args.delay:
            await asyncio.sleep(self.args.delay)
        await self.resumed.wait()  # held while paused
        sp = body.get("sampling_params", {})
        n = int(sp.get("n", 1))
        rid, plen = body.get("rid", "fake"), len(body["input_ids"])
        reply = self.reply_for(body["input_ids"])
        total, fr = self.plan(sp.get("max_new_tokens"), sp.get("stop") or [], reply)
        if self.args.token_delay:
            self.inflight += 1
            try:
                return await self.generate_slowly(request, body, rid, plen, n, total, fr, reply)
            finally:
                self.inflight -= 1
        if not body.get("stream"):
            items = [self.item(rid, plen, total, i, total, fr, reply) for i in range(n)]
            return web.Response(body=orjson.dumps(items if n > 1 else items[0]), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if self.args.one_write:  # the whole stream at once, as a gateway that reads behind an engine sees it
                events = [self.item(rid, plen, k, i, total, fr, reply) for k in range(1, total + 1) for i in range(n)]
                await resp.write(b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n")
                return resp
            for k in range(1, total + 1):
                for i in range(n):
                    await resp.write(b"data: " + orjson.dumps(self.item(rid, plen, k, i, total, fr, reply)) + b"\n\n")
                if self.args.stream_delay:
                    await asyncio.sleep(self.args.stream_delay)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted.append(rid)
            raise
        return resp

    async def generate_slowly(self, request: web.Request, body: dict, rid: str, plen: int, n: int, total: int,
                              fr: dict, reply: tuple[list[int], list[str]]) -> web.StreamResponse:
        """One token per ``--token-delay``; a pause cuts the generation (finish_reason abort)."""
        epoch, resp, k = self.pauses, None, 0
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
        while k < total and self.pauses == epoch and rid not in self.cut:
            await asyncio.sleep(self.args.token_delay)
            if self.pauses != epoch or rid in self.cut:
                break
            k += 1
            if resp is not None:
                for i in range(n):
                    await resp.write(b"data: " + orjson.dumps(self.item(rid, plen, k, i, total, fr, reply))
                                     + b"\n\n")
        if k < total:
            total, fr = k, {"type": "abort", "message": "Aborted", "status_code": None}
        items = [self.item(rid, plen, k, i, total, fr, reply) for i in range(n)]
        if resp is None:
            return web.Response(body=orjson.dumps(items if n > 1 else items[0]), content_type="application/json")
        if fr["type"] == "abort":
            for it in items:
                await resp.write(b"data: " + orjson.dumps(it) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def control(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read() or b"{}")
        self.controls.append({"path": request.path, "body": body})
        if request.path == "/pause_generation":
            self.pauses += 1
            self.resumed.clear()
            while self.inflight:  # like SGLang: returns once the aborted responses are out
                await asyncio.sleep(0.005)
            return web.json_response({"message": "Generation paused successfully.", "status": "ok"})
        if request.path == "/continue_generation":
            self.resumed.set()
            return web.json_response({"message": "Generation continued successfully.", "status": "ok"})
        if request.path in DISTRIBUTED:
            return await self.distributed(request.path, body)
        from pathlib import Path

        path = Path(str(body.get("model_path")))
        if not path.is_dir() or any(path == Path(d) or Path(d) in path.parents for d in self.cannot_read):
            return web.json_response({"success": False, "message": f"Failed to update weights: no directory "
                                      f"{body.get('model_path')!r}", "num_paused_requests": 0}, status=400)
        if body.get("weight_version") is not None:
            self.version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def distributed(self, path: str, body: dict[str, Any]) -> web.Response:
        if path == "/flush_cache":
            if self.inflight and self.resumed.is_set():
                return web.Response(text="Cache not flushed: requests are running", status=400)
            return web.Response(text="Cache flushed.")
        if path == "/begin_weight_update":
            self.in_session, self.staged_version = True, None
        elif path == "/end_weight_update":
            if self.args.staged and not body.get("discard") and self.staged_version is not None:
                self.version = self.staged_version
            self.in_session, self.staged_version = False, None
        elif path == "/update_weights_from_distributed":
            if not self.in_session and not self.args.no_weight_session:
                return web.json_response({"success": False, "message": "not inside begin_weight_update"}, status=400)
            try:
                names = await asyncio.wait_for(self.broadcasts.get(), 10)
            except TimeoutError:
                return web.json_response({"success": False, "message": "no broadcast received"}, status=400)
            if names != body.get("names") or any("fail" in n for n in names):
                return web.json_response({"success": False, "message": f"failed to load {names}"}, status=400)
            if body.get("weight_version") is not None:
                if self.args.staged and self.in_session:
                    self.staged_version = str(body["weight_version"])
                else:
                    self.version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "ok"})

    async def broadcast(self, request: web.Request) -> web.Response:
        self.broadcasts.put_nowait(orjson.loads(await request.read())["names"])
        return web.json_response({"success": True})

    async def model_info(self, _: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.args.tokenizer or "fake", "served_model_name": self.args.model_name,
            "tokenizer_path": self.args.tokenizer, "is_generation": True,
            "weight_version": self.version,
            **({"staged_weight_updates": True} if self.args.staged else {}),
        })

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def abort(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        rid = body.get("rid", "")
        self.abort_bodies.append(body)
        self.aborted.append(rid)
        self.cut.add(rid)
        return web.Response()

    async def debug(self, _: web.Request) -> web.Response:
        """Test hook: the requests received (with ``--record``), the rids aborted and the bodies of
        ``/abort_request``."""
        return web.Response(text=json.dumps({"requests": self.requests, "aborted": self.aborted,
                                             "controls": self.controls, "abort_bodies": self.abort_bodies}),
                            content_type="application/json")


def build_app(args: argparse.Namespace) -> web.Application:
    fake = Fake(args)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/generate", fake.generate)
    app.router.add_get("/model_info", fake.model_info)
    app.router.add_get("/health", fake.health)
    app.router.add_post("/abort_request", fake.abort)
    app.router.add_get("/debug", fake.debug)
    app.router.add_post("/debug/broadcast", fake.broadcast)
    for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk", *DISTRIBUTED):
        if not (args.no_weight_session and path in ("/begin_weight_update", "/end_weight_update")):
            app.router.add_post(path, fake.control)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokenizer", default=None, help="directory with tokenizer.json")
    p.add_argument("--eos", default="<|im_end|>", help="the token that ends a reply (with --tokenizer)")
    p.add_argument("--reply", default="Hello! 2 + 3 = 5.")
    p.add_argument("--reply-when", action="append", default=[], metavar="KEY=TEXT",
                   help="answer TEXT when the prompt contains KEY (repeatable; needs --tokenizer)")
    p.add_argument("--tokens", type=int, default=16, help="reply length without --tokenizer")
    p.add_argument("--cannot-read", action="append", default=[], metavar="DIR",
                   help="refuse to load weights under DIR as if it were missing (an engine on a host without "
                        "that volume; repeatable)")
    p.add_argument("--model-name", default="fake-model")
    p.add_argument("--weight-version", default="v0")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--stream-delay", type=float, default=0.0)
    p.add_argument("--one-write", action="store_true", help="send a stream's events in one write")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds per generated token (pausable)")
    p.add_argument("--record", action="store_true", help="keep received requests for GET /debug")
    p.add_argument("--staged", action="store_true",
                   help="stage a session's buckets until /end_weight_update, which {\"discard\": true} drops "
                        "(the embedded engine's behaviour, model_info's staged_weight_updates)")
    p.add_argument("--no-weight-session", action="store_true", help="no begin/end_weight_update (SGLang < 0.5.23)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(build_app(args), host=args.host, port=args.port, access_log=None, print=None,
                shutdown_timeout=0.5)  # a test stopping it must not wait for a --delay request


if __name__ == "__main__":
    main()
