"""A stand-in for SGLang's receiving side of a distributed weight update, for the gloo test in
``test_disk.py`` (no tests here). It is not SGLang: it answers the control routes the gateway's
coordinator posts, joins the weight-update group the way SGLang's ``init_custom_process_group`` does
(read from its source) as rank ``rank_offset``, and in ``/update_weights_from_distributed`` receives one
``dist.broadcast(src=0)`` per announced tensor, in order, like SGLang's handler.

The product's receiver is the embedded engine (``engine/dist_weights.py``; end to end in
``tests/e2e/test_distributed_swap.py``). This stand-in stays for the fast test because it records what
the engine is asked (the exact route sequence) and what arrived (per-tensor sums), which no engine reports.

    python -m tests.trainer.weights.weight_receiver --port N

``GET /debug/weights`` lists what arrived: ``{name: {"dtype", "shape", "sum"}}`` and the paths posted."""

from __future__ import annotations

import argparse
import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.rendezvous import rendezvous


class Receiver:
    def __init__(self) -> None:
        self.group: Any = None
        self.version = "base"
        self.weights: dict[str, dict[str, Any]] = {}
        self.paths: list[str] = []
        self.lock = threading.Lock()

    def init_group(self, b: dict[str, Any]) -> dict[str, Any]:
        timeout = timedelta(seconds=60)
        url = f"tcp://{b['master_address']}:{b['master_port']}"
        store, rank, size = next(rendezvous(url, b["rank_offset"], b["world_size"], timeout=timeout))
        store.set_timeout(timeout)
        self.group, _ = c10d._new_process_group_helper(
            size, rank, [], b["backend"], c10d.PrefixStore(b["group_name"], store), group_name=b["group_name"],
            timeout=timeout)
        c10d._world.pg_group_ranks[self.group] = {i: i for i in range(size)}
        return {"success": True, "message": "joined"}

    def receive(self, b: dict[str, Any]) -> dict[str, Any]:
        for name, dtype, shape in zip(b["names"], b["dtypes"], b["shapes"], strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(t, src=0, group=self.group)
            self.weights[name] = {"dtype": dtype, "shape": shape, "sum": float(t.double().sum())}
        if b.get("weight_version") is not None:
            self.version = str(b["weight_version"])
        return {"success": True, "message": f"received {len(b['names'])} tensors"}

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.paths.append(path)
        if path == "/init_weights_update_group":
            return 200, self.init_group(body)
        if path == "/update_weights_from_distributed":
            return 200, self.receive(body)
        if path in ("/pause_generation", "/continue_generation", "/flush_cache", "/begin_weight_update",
                    "/end_weight_update"):
            return 200, {"success": True, "message": "ok"}
        return 404, {"message": f"no route {path}"}


def serve(port: int) -> None:
    rec = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            self._send(*rec.handle(self.path, json.loads(self.rfile.read(n)) if n else {}))

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/model_info":
                self._send(200, {"weight_version": rec.version, "served_model_name": "receiver"})
            elif self.path == "/debug/weights":
                self._send(200, {"weights": rec.weights, "paths": rec.paths})
            else:
                self._send(404, {})

        def log_message(self, *args: Any) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    serve(p.parse_args().port)
