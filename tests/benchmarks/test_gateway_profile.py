"""The profile's grouping of sampled stacks into stages (benchmarks/gateway_profile.py)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gateway_profile import read_raw, stage_of

SITE = "/venv/lib/python3.11/site-packages"
RUNNER = "Runner.run (/usr/lib/python3.11/asyncio/runners.py:118)"


def test_the_innermost_project_frame_names_the_stage_library_frames_below_it_included() -> None:
    commit = [RUNNER, "record_durably (/repo/gateway/traces/recorder.py:395)",
              f"execute (/{SITE}/sqlalchemy/engine/base.py:1418)"]
    assert stage_of(commit) == "recording the span (encode, queue, store, commit)"
    tokenize = [RUNNER, "run_call (/repo/gateway/proxy/call_path.py:145)",
                "apply (/repo/gateway/proxy/prompt/templating.py:426)", f"encode ({SITE}/tokenizers/x.py:1)"]
    assert stage_of(tokenize) == "prompt: render and tokenize, prefix plan"
    assert stage_of([RUNNER, "run_call (/repo/gateway/proxy/call_path.py:145)"]).startswith("call path")


def test_the_loop_and_thread_hand_offs_are_their_own_stages_whatever_called_them() -> None:
    assert stage_of(["main (/repo/sdk/cli.py:10)", "serve (/repo/gateway/serve.py:99)", RUNNER]).startswith(
        "event loop")
    notify = [RUNNER, "record (/repo/gateway/traces/recorder.py:300)",
              "Condition.notify (/usr/lib/python3.11/threading.py:382)"]
    assert stage_of(notify) == "threads (waits, hand-offs)"
    server = [f"data_received ({SITE}/uvicorn/protocols/http/httptools_impl.py:174)"]
    assert stage_of(server) == "HTTP server (uvicorn, httptools)"
    assert stage_of(["<module> (/elsewhere/x.py:1)"]) == "other"


def test_raw_lines_are_stacks_and_counts(tmp_path: Path) -> None:
    raw = tmp_path / "p.raw"
    raw.write_text(f"{RUNNER};f (/repo/gateway/app.py:1) 7\n{RUNNER} 3\nnot a sample line\n")
    assert read_raw(raw) == [([RUNNER, "f (/repo/gateway/app.py:1)"], 7), ([RUNNER], 3)]
