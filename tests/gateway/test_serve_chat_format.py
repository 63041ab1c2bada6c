"""``tracegym serve --chat-format``: the flag names the model family (over ``$TRACEGYM_CHAT_FORMAT``), and a
name no family has stops the gateway before anything starts, listing the families."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from tests.procs import run_command
from tracegym.cli import build_parser
from tracegym.gateway.proxy.prompt.families import FAMILIES
from tracegym.gateway.serve import check_chat_format, settings_from_args
from tracegym.gateway.settings import GatewaySettings


def _args(*argv: str):
    return build_parser().parse_args(["serve", "--upstream", "http://127.0.0.1:1", "--store", "none", *argv])


def test_the_flag_names_the_family_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEGYM_CHAT_FORMAT", "qwen3")
    assert settings_from_args(_args("--chat-format", "llama3"), "http://127.0.0.1:1", "sglang").chat_format == "llama3"
    assert settings_from_args(_args(), "http://127.0.0.1:1", "sglang").chat_format == "qwen3"
    monkeypatch.delenv("TRACEGYM_CHAT_FORMAT")
    assert settings_from_args(_args(), "http://127.0.0.1:1", "sglang").chat_format is None


def test_an_unknown_family_is_an_error_listing_the_families(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRACEGYM_CHAT_FORMAT", raising=False)
    check_chat_format(_args("--chat-format", "gpt_oss"))
    with pytest.raises(SystemExit) as e:
        check_chat_format(_args("--chat-format", "mistral"))
    message = str(e.value.code)
    assert message.startswith("tracegym serve: --chat-format: unknown chat format 'mistral'")
    assert all(name in message for name in FAMILIES)
    monkeypatch.setenv("TRACEGYM_CHAT_FORMAT", "llama2")
    with pytest.raises(SystemExit, match=r"\$TRACEGYM_CHAT_FORMAT: unknown chat format 'llama2'"):
        check_chat_format(_args())
    with pytest.raises(ValidationError, match="the families are: gpt_oss, deepseek_v3"):
        GatewaySettings(chat_format="llama2")


def test_serve_stops_on_an_unknown_family_before_starting_anything() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRACEGYM_CHAT_FORMAT"}
    res = run_command(["tracegym", "serve", "--engine", "embedded", "--model", "tiny-random", "--chat-format",
                       "Llama3"], env=env, timeout=120)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown chat format 'Llama3'" in lines[0] and "llama3, gemma3" in lines[0], lines
