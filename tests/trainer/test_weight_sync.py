"""Weight export and the request sequences of the disk and NCCL weight updates.

The NCCL path cannot run here (no GPUs): its HTTP sequence and payloads are checked against a recording
HTTP server that answers like SGLang (SGLANG.md §3), with the broadcast injected as a function."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from tracegym.trainer.weight_sync import (
    DiskWeightSync,
    NcclWeightSync,
    WeightSyncError,
    bucket_tensors,
    write_weights_dir,
)


class Recorder:
    """A real HTTP server recording ``(path, body)``; ``/update_weights_from_distributed`` answers only
    once the test's broadcast for that bucket has run (as SGLang's handler returns after receiving)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail: set[str] = set()
        self.flush_busy = 0
        self.bucket_received = threading.Event()
        self.broadcast_done = threading.Event()
        self.lock = threading.Lock()

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.calls.append((path, body))
        if path in self.fail:
            return 400, {"success": False, "message": f"{path} refused"}
        if path == "/flush_cache":
            if self.flush_busy:
                self.flush_busy -= 1
                return 400, {"message": "requests running"}
            return 200, {}
        if path == "/update_weights_from_distributed":
            self.bucket_received.set()
            if not self.broadcast_done.wait(10):
                return 500, {"success": False, "message": "no broadcast"}
            self.broadcast_done.clear()
        return 200, {"success": True, "message": "ok"}


@pytest.fixture
def recorder() -> Iterator[tuple[Recorder, str]]:
    rec = Recorder()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            status, body = rec.handle(self.path, json.loads(raw) if raw else {})
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield rec, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_write_weights_dir_loads_with_from_pretrained(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tensors = {n: p.detach() + 0.5 for n, p in model.named_parameters()}  # tied lm_head appears once
    out = write_weights_dir(tensors, tiny_model_dir, tmp_path / "v3")
    assert {p.name for p in out.iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for n, p in loaded.named_parameters():
        assert torch.equal(p, tensors[n]), n
    assert torch.equal(loaded.lm_head.weight, tensors["model.embed_tokens.weight"])


class FakeGroup:
    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.saved: list[Path] = []

    def save_weights(self, out_dir: Path, dtype: str | None = None) -> Path:
        self.saved.append(out_dir)
        return write_weights_dir({"w": torch.ones(2)}, self.model_dir, out_dir)


def test_disk_push_posts_version_and_prunes(
    recorder: tuple[Recorder, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    rec, url = recorder
    sync = DiskWeightSync(url, tmp_path / "weights", keep=2)
    group = FakeGroup(tiny_model_dir)
    results = [sync.push(group, v) for v in (1, 2, 3)]
    assert [p for p, _ in rec.calls] == ["/update_weights_from_disk"] * 3
    assert rec.calls[2][1] == {"model_path": str(tmp_path / "weights" / "v3"), "weight_version": "3"}
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v2", "v3"]
    r = results[-1]
    assert r.version == "3" and r.total_s >= r.save_s + r.update_s - 1e-6 and r.update_s > 0
    with pytest.raises(ValueError, match="must match"):
        sync.version_dir("../x")
    # a restarted trainer (resume) counts the directories already there
    DiskWeightSync(url, tmp_path / "weights", keep=2).push(group, 4)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v3", "v4"]


def test_disk_push_with_pause_and_failure(
    recorder: tuple[Recorder, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    rec, url = recorder
    sync = DiskWeightSync(url, tmp_path / "w", pause=True)
    sync.push(FakeGroup(tiny_model_dir), "7")
    assert [p for p, _ in rec.calls] == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    assert rec.calls[1][1]["abort_all_requests"] is True
    rec.calls.clear()
    rec.fail.add("/update_weights_from_disk")
    with pytest.raises(WeightSyncError, match="update_weights_from_disk failed: HTTP 400"):
        sync.push(FakeGroup(tiny_model_dir), "8")
    assert rec.calls[-1][0] == "/continue_generation"  # generation resumes even after a failed load


def test_bucket_tensors_keeps_order_and_budget() -> None:
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5, 5])]  # fp32: 4 bytes each
    buckets = list(bucket_tensors(named, 80))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]


def test_nccl_sequence_and_payloads(recorder: tuple[Recorder, str]) -> None:
    rec, url = recorder
    rec.flush_busy = 2
    sync = NcclWeightSync(url, bucket_bytes=48, flush_interval_s=0.01)  # a+b = 48 bytes
    joined = sync.init_group("10.0.0.1", 29999, world_size=3, join=lambda: "pg")
    assert joined == "pg"
    assert rec.calls[0] == (
        "/init_weights_update_group",
        {
            "master_address": "10.0.0.1",
            "master_port": 29999,
            "rank_offset": 1,
            "world_size": 3,
            "group_name": "weight_update_group",
            "backend": "nccl",
        },
    )
    rec.calls.clear()

    named = [("a", torch.zeros(4, 2, dtype=torch.bfloat16)), ("b", torch.zeros(8)), ("c", torch.zeros(3))]
    sent: list[list[str]] = []

    def broadcast(tensors: list[torch.Tensor]) -> None:
        # the HTTP update must already be pending when the broadcast runs (else both sides would block)
        assert rec.bucket_received.wait(5), (
            "update_weights_from_distributed was not posted before broadcasting"
        )
        rec.bucket_received.clear()
        sent.append([str(tuple(t.shape)) for t in tensors])
        rec.broadcast_done.set()

    result = sync.push(named, 12, broadcast)
    paths = [p for p, _ in rec.calls]
    assert paths == [
        "/pause_generation",
        "/flush_cache",
        "/flush_cache",
        "/flush_cache",
        "/begin_weight_update",
        "/update_weights_from_distributed",
        "/update_weights_from_distributed",
        "/end_weight_update",
        "/continue_generation",
    ]
    updates = [b for p, b in rec.calls if p == "/update_weights_from_distributed"]
    assert updates[0] == {
        "names": ["a", "b"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[4, 2], [8]],
        "group_name": "weight_update_group",
        "flush_cache": False,
        "weight_version": "12",
    }
    assert updates[1]["names"] == ["c"] and updates[1]["shapes"] == [[3]]
    assert sent == [["(4, 2)", "(8,)"], ["(3,)"]]
    assert result.version == "12" and result.path is None


def test_nccl_failure_still_ends_and_continues(recorder: tuple[Recorder, str]) -> None:
    rec, url = recorder
    rec.fail.add("/update_weights_from_distributed")
    sync = NcclWeightSync(url, begin_end=True)
    with pytest.raises(WeightSyncError, match="update_weights_from_distributed failed"):
        sync.push([("a", torch.zeros(2))], "1", lambda tensors: None)
    assert [p for p, _ in rec.calls][-2:] == ["/end_weight_update", "/continue_generation"]
    rec.calls.clear()
    rec.fail.clear()
    old = NcclWeightSync(url, begin_end=False)  # SGLang < 0.5.23 has no begin/end endpoints
    rec.broadcast_done.set()
    old.push([("a", torch.zeros(2))], "2", lambda tensors: None)
    assert "/begin_weight_update" not in [p for p, _ in rec.calls]
