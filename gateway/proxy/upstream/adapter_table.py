"""Which LoRA adapter serves which call (the gateway's side of one adapter per agent role).

The trainer pushes adapters by name: one named ``default`` for every call, or one per agent role named
after the agent (``X-Agent-Name``, ``tg.rollout(agent_name=...)``). Each swap loads them into the
upstream under versioned names (``planner-v3``: SGLang's ``lora_name``, sent back as ``lora_path`` on
``/generate``), and ``install`` switches the table to those names in one assignment. A call keeps its
*logical* adapter (``planner``); the served name is looked up each time a request is posted, so a call
continued across a swap resumes on the new adapter. The table is owned by the SGLang upstream and
changed only by ``swap.SwapCoordinator``."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_ADAPTER = "default"


@dataclass(slots=True)
class AdapterTable:
    served: dict[str, str] = field(default_factory=dict)
    """Logical adapter → the name it is loaded under now."""
    per_agent: bool = False

    def adapter_for(self, agent_name: str | None) -> str | None:
        """The logical adapter of an agent's calls (None: the base model)."""
        if not self.served:
            return None
        if not self.per_agent:
            return DEFAULT_ADAPTER if DEFAULT_ADAPTER in self.served else None
        return agent_name if agent_name in self.served else None

    def served_name(self, adapter: str | None) -> str | None:
        return None if adapter is None else self.served.get(adapter)

    def install(self, served: dict[str, str], *, per_agent: bool) -> dict[str, str]:
        """Serve ``served`` from now on (adapters not in it keep their current names); returns the
        names replaced, to unload."""
        old = {k: v for k, v in self.served.items() if k in served and served[k] != v}
        self.served = {**self.served, **served}
        self.per_agent = per_agent
        return old

    def snapshot(self) -> dict[str, object]:
        return {"per_agent": self.per_agent, "served": dict(self.served)}
