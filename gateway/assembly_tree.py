"""The prefix tree behind merge assembly, and its linearisation into masked sequences.

Each trained call choice is a node: ``prompt`` (mask 0) followed by ``output`` (mask 1). A node's parent
is the deepest earlier node of the same agent whose ``prompt + output`` is a prefix of the node's prompt
(so a call extends whichever earlier branch it continues, not only the last one). Every leaf becomes one
sequence; a node's sampled tokens are trained (mask 1) in exactly one of the leaves below it, the one
reached by following *heirs* (the child with the largest subtree, the earliest on ties); in every other
leaf they are context (mask 0). So an n>1 call's choices are separate branches, the branch a later call
continues carries the history, and the others end as their own sequences.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from tracegym.gateway.assembly_calls import TokenCall, TokenChoice, extends


@dataclass(slots=True, eq=False)
class Node:
    pos: int
    """Index of the call in the rollout (start order)."""
    call: TokenCall
    choice: TokenChoice
    prompt: bytes
    """The call's prompt ids (a blob; every id blob of the rollout has one tag, see ``token_calls``)."""
    output: bytes
    """The choice's output ids (a blob of the same tag)."""
    logprobs: bytes | None
    """The engine's logprobs of ``output`` (a blob); None for retokenized calls."""
    retokenized: bool
    start: int
    """Number of prompt ids: the sequence position of the first output id."""
    end: int
    """``start`` + number of output ids."""
    parent: Node | None = None
    """Only the parent is linked (no child lists): the tree has no reference cycles, so it is freed by
    reference counting as soon as the sequences are built."""
    has_children: bool = False
    size: int = 1

    def continues(self, prompt: bytes) -> bool:
        """True when ``prompt`` (a blob of the same tag) starts with this node's prompt + output."""
        return extends(prompt, self.prompt, self.output)


@dataclass(slots=True)
class Chain:
    """One leaf's trained part: ``nodes[0]``'s whole prompt is context, then every node's prompt
    suffix (mask 0) and output (mask 1)."""

    nodes: list[Node]


def find_parent(candidates: list[Node], prompt: bytes, length: int) -> Node | None:
    """The deepest candidate that ``prompt`` (a blob of ``length`` ids) continues; on equal depth a
    childless one, then the earliest. ``candidates`` are sorted by ``end`` descending (creation order
    within equal ends), so the search stops at the first depth that matches."""
    best: Node | None = None
    for node in candidates[bisect.bisect_left(candidates, -length, key=lambda c: -c.end) :]:
        if best is not None and (node.end < best.end or not best.has_children):
            break
        if node.continues(prompt) and (best is None or (best.has_children and not node.has_children)):
            best = node
    return best


def link(nodes_by_call: list[list[Node]]) -> list[Node]:
    """Set parents for the nodes of one agent (grouped per call, calls in start order); return all
    nodes in creation order. Nodes of the same call never parent each other."""
    by_depth: list[Node] = []
    for siblings in nodes_by_call:
        parent = find_parent(by_depth, siblings[0].prompt, siblings[0].start)
        for node in siblings:
            node.parent = parent
        if parent is not None:
            parent.has_children = True
        for node in siblings:
            bisect.insort_right(by_depth, node, key=lambda c: -c.end)
    return [n for siblings in nodes_by_call for n in siblings]


def chains(nodes: list[Node]) -> list[Chain]:
    """The trained chain of every leaf of a linked forest (``nodes`` in creation order)."""
    for node in reversed(nodes):
        if node.parent is not None:
            node.parent.size += node.size
    heirs: dict[int, Node] = {}  # id(parent) -> the child with the largest subtree, the first on ties
    for node in nodes:
        if node.parent is not None:
            current = heirs.get(id(node.parent))
            if current is None or node.size > current.size:
                heirs[id(node.parent)] = node
    out: list[Chain] = []
    for leaf in nodes:
        if leaf.has_children:
            continue
        path = [leaf]
        while path[-1].parent is not None and heirs[id(path[-1].parent)] is path[-1]:
            path.append(path[-1].parent)
        path.reverse()
        out.append(Chain(path))
    return out


def single_chains(nodes: list[Node]) -> list[Chain]:
    """Per-call mode: every node is its own sequence."""
    return [Chain([n]) for n in nodes]
