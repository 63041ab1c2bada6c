"""Options of trajectory assembly: one frozen dataclass, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

AssemblyMode = Literal["merge", "per_call"]
MODES: tuple[str, ...] = ("merge", "per_call")


@dataclass(frozen=True, slots=True)
class AssemblyOptions:
    """How a rollout's calls become training sequences.

    - ``mode``: ``"merge"`` folds calls that extend an earlier call's prompt+output into one sequence;
      ``"per_call"`` makes one sequence per call choice.
    - ``agent_match``: which agents are trained (Agent Lightning's ``agent_match``): a regex searched in
      the agent name (a call without a name is matched as ``""``), or a tuple of exact names; None
      trains every agent.
    - ``include_retokenized``: also train calls whose ids were re-derived or that lack engine logprobs;
      their sequences are flagged ``retokenized`` and carry None logprobs on sampled tokens (for SFT
      export, not on-policy RL).
    - ``include_errors``: also train the tokens produced by calls that ended in error.
    - ``gamma``: per-sequence discount; a sequence's reward is ``reward * gamma**d`` where ``d`` counts
      the later sequence end points (0 for the sequence(s) holding the rollout's last call).
    """

    mode: AssemblyMode = "merge"
    agent_match: str | tuple[str, ...] | None = None
    include_retokenized: bool = False
    include_errors: bool = False
    gamma: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1]; got {self.gamma!r}")
        match = self.agent_match
        if isinstance(match, list):
            object.__setattr__(self, "agent_match", tuple(match))
        elif isinstance(match, str):
            try:
                re.compile(match)
            except re.error as e:
                raise ValueError(f"agent_match is not a valid regex: {match!r} ({e})") from e
        elif match is not None and not isinstance(match, tuple):
            raise ValueError(f"agent_match must be a regex, a list of names or None; got {match!r}")
        if isinstance(self.agent_match, tuple) and not all(isinstance(n, str) for n in self.agent_match):
            raise ValueError(f"agent_match names must be strings; got {self.agent_match!r}")

    def trains_agent(self, agent_name: str | None) -> bool:
        match = self.agent_match
        if match is None:
            return True
        if isinstance(match, tuple):
            return agent_name in match
        return re.search(match, agent_name or "") is not None
