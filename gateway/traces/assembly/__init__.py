"""Trajectory assembly: a rollout's recorded calls → token-exact training sequences, and their check.

``assemble`` / ``assemble_rollout`` build a ``Trajectory`` (``merge``, over the prefix tree of ``tree``);
``check_invariants`` verifies one against its calls (``invariants``); ``AssemblyOptions`` selects the mode,
the agents and the calls brought back (``options``); rewards are attached per sequence (``rewards``).
"""

from tracegym.gateway.traces.assembly.invariants import InvariantError, check_invariants
from tracegym.gateway.traces.assembly.merge import assemble, assemble_rollout, exclusion_reason
from tracegym.gateway.traces.assembly.options import MODES, AssemblyMode, AssemblyOptions

__all__ = [
    "MODES",
    "AssemblyMode",
    "AssemblyOptions",
    "InvariantError",
    "assemble",
    "assemble_rollout",
    "check_invariants",
    "exclusion_reason",
]
