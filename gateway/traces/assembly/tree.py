"""The prefix tree behind merge assembly, and its linearisation into chains (one per sequence).

Each trained call choice is a node: ``prompt`` (mask 0) followed by ``output`` (mask 1). A node's parent
is the deepest earlier node of the same agent whose ``prompt + output`` is a prefix of the node's prompt;
on equal depth a childless one, then the earliest (so a call extends whichever earlier branch it
continues, not only the last one). Every leaf becomes one sequence; a node's sampled tokens are trained
(mask 1) in exactly one of the leaves below it, the one reached by following *heirs* (the child with the
largest subtree, the earliest on ties); in every other leaf they are context (mask 0). So an n>1 call's
choices are separate branches, the branch a later call continues carries the history, and the others end
as their own sequences.
"""

from __future__ import annotations

from bisect import bisect_right

import msgspec

from tracegym.gateway.traces.token_calls import TokenCall, TokenChoice


class Node(msgspec.Struct, gc=False, eq=False):
    """One trained call choice. Untracked by the garbage collector (``gc=False``): nodes link only to
    their parent, never to children, so they form no reference cycle and are freed by reference counting
    as soon as the sequences are built."""

    pos: int
    """Index of the call in the rollout (start order)."""
    call: TokenCall
    choice: TokenChoice
    prompt: bytes
    """The call's prompt ids (a blob; every id blob of the rollout has one tag, see ``token_calls``)."""
    output: bytes
    """The choice's output ids (a blob of the same tag)."""
    logprobs: bytes | None
    """The engine's logprobs of ``output`` (a blob); None when the sequence cannot carry them
    (retokenized call, or no engine logprobs)."""
    start: int
    """Number of prompt ids: the sequence position of the first output id."""
    end: int
    """``start`` + number of output ids."""
    parent: Node | None = None
    has_children: bool = False
    size: int = 1
    """Nodes in this node's subtree (final once ``chains`` has passed all its children)."""
    heir_size: int = 0
    heir_chain: int = -1
    """Index (in ``chains``' result) of the chain of the heir found so far, and its subtree size."""


def link(nodes: list[Node]) -> list[Node]:
    """Set the parents of one agent's nodes (in creation order: calls in start order, a call's choices
    one after another) and return them. A call's choices share one parent and never parent each other.

    A prompt continues a node when its bytes start with the node's prompt blob (tag included) and then the
    node's output values: id blobs of one tag hold equal ids exactly when their bytes are equal. The nodes
    linked so far are kept sorted by ``end`` (creation order within equal ends), with ``ends`` alongside
    for ``bisect``; the search walks them deepest first, from the last one not longer than the prompt. In
    the usual rollout every call continues the one before it: that node is the deepest so far, the walk
    stops after its one prefix test, and the new node is appended."""
    linked: list[Node] = []
    ends: list[int] = []
    parent: Node | None = None
    pos = -1
    for new in nodes:
        if new.pos != pos:  # a call's first choice: find the parent all its choices share
            pos, prompt, parent = new.pos, new.prompt, None
            i = bisect_right(ends, new.start)  # deeper nodes cannot be a prefix of the prompt
            while i:
                i -= 1
                node = linked[i]
                if parent is not None and node.end < parent.end:
                    break
                # on equal depth, walking backwards (later first): an earlier match wins unless it has
                # children and the one found does not
                if ((parent is None or parent.has_children or not node.has_children)
                        and prompt.startswith(node.prompt)
                        and prompt.startswith(node.output[1:], len(node.prompt))):
                    parent = node
            if parent is not None:
                parent.has_children = True
        new.parent = parent
        i = bisect_right(ends, new.end)
        ends.insert(i, new.end)
        linked.insert(i, new)
    return nodes


def chains(nodes: list[Node]) -> list[list[Node]]:
    """The trained chain of every leaf of a linked forest (``nodes`` in creation order): the leaf and its
    ancestors up to the first one it is not the heir of, root side first.

    One pass from the last node back: children come after their parent, so a node's subtree size and heir
    are final when it is reached, and it joins its heir's chain (a leaf starts one)."""
    out: list[list[Node]] = []
    for node in reversed(nodes):
        if node.has_children:
            at = node.heir_chain
            out[at].append(node)
        else:
            at = len(out)
            out.append([node])
        parent = node.parent
        if parent is not None:
            parent.size += node.size
            if node.size >= parent.heir_size:  # >=: the children are met latest first, the earliest wins ties
                parent.heir_size = node.size
                parent.heir_chain = at
    for chain in out:
        chain.reverse()
    return out
