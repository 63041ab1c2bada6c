"""The gateway's LoRA routing table: which adapter serves an agent, and what a swap replaces."""

from __future__ import annotations

from tracegym.gateway.proxy.upstream.adapter_table import AdapterTable


def test_routing_before_and_after_swaps() -> None:
    t = AdapterTable()
    assert t.adapter_for("planner") is None and t.served_name(None) is None  # nothing loaded: the base
    assert t.install({"default": "default-v1"}, per_agent=False) == {}
    assert t.adapter_for("planner") == t.adapter_for(None) == "default"
    assert t.served_name("default") == "default-v1"
    replaced = t.install({"planner": "planner-v2", "executor": "executor-v2"}, per_agent=True)
    assert replaced == {}
    assert t.adapter_for("planner") == "planner" and t.adapter_for("critic") is None
    assert t.install({"planner": "planner-v3", "executor": "executor-v3"}, per_agent=True) == {
        "planner": "planner-v2", "executor": "executor-v2"}
    assert t.served_name("executor") == "executor-v3"
    assert t.snapshot() == {"per_agent": True, "served": {"default": "default-v1", "planner": "planner-v3",
                                                          "executor": "executor-v3"}}
