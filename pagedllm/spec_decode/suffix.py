"""Suffix decoding (vLLM's, after Arctic Inference): propose the most frequent continuation of
the sequence's latest tokens, from a tree over the sequence itself and one over earlier
requests' outputs, for agentic and repeated work where answers echo what came before.

SuffixTree counts every substring of up to `depth` tokens of its texts: count(w) is the number
of places w occurs. A substring that occurs once needs no node: its parent keeps a reference
(text, position) to the one occurrence, whose continuation is read from the text itself. A node
is made only for a substring seen twice, so a tree costs memory in proportion to what repeats
(copying a 1,000-token passage makes ~1,000 x depth nodes), not to the texts' length times depth.

Appending a token to a text updates, for each suffix of the text still shorter than `depth`
that has a node, that node's child: O(repeated suffixes) per token, never a rebuild. A tree has
at most one open (growing) text; the others are complete, so when a second occurrence meets a
reference, the first occurrence's next token is always known (for the open text, the two
occurrences differ in start, so the earlier one's next token is already appended).

Proposing for a sequence of length L, per tree (the sequence's own; the shared one of earlier
outputs), per match length m from min(L, depth - 1) down to 1: w = the last m tokens, and from
w, while the proposal is shorter than min(k, floor(m * max_spec_factor), depth - m): the child
with the highest count (the smallest token id among equal counts), its probability
count(child) / count(parent) multiplied into the running product, stopping before a token
whose product falls below min_token_prob. A proposal's score is the sum of its products (its
expected accepted tokens, if the counts were the odds). The highest score wins; among equal
scores the longer match, and the sequence's own tree before the shared one. Since a proposal
from match m scores at most min(k, floor(m * factor)), the search stops once no shorter match
can beat what it has, and skips a start whose first token's probability times its length limit
cannot (each node keeps its most frequent child as counts rise, so that costs O(1)).

The shared tree holds the outputs of the last suffix_decoding_max_cached_requests requests to
finish (the least recently finished leave first; their counts come out again). Nodes left with
one occurrence after a removal stay nodes (memory is what the tree held at its largest).

Costs, measured on the corpus's text (SmolLM2's tokens, depth 24): ~1.2 nodes and ~450 bytes
per token of a shared tree's outputs, ~8 µs per token appended to a sequence's own tree (a 4k
prompt: ~30 ms once), and a proposal for 64 sequences of 4k tokens in ~1.7 ms
(`pagedllm bench proposers`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pagedllm.spec_decode.proposer import SequenceTokens, check_max_tokens

# A child is a _Node (a substring seen at least twice) or a reference (text, position) to the
# one occurrence: text[position] is the child's token, what follows it in text its continuation.
_Ref = tuple  # (list[int], int)


class _Node:
    __slots__ = ("count", "depth", "children", "best")

    def __init__(self, count: int, depth: int) -> None:
        self.count = count
        self.depth = depth  # the substring's length
        self.children: dict[int, _Node | _Ref] = {}
        # The child a proposal follows (highest count, then smallest token), kept as counts rise;
        # None: not known (no children, or a removal lowered counts), found again when read.
        self.best: int | None = None

    def child_rose(self, token: int) -> None:
        """The count of child `token` went up (or it is new): it may now be the best."""
        best = self.best
        if best is None or best == token:
            self.best = token if best is not None or len(self.children) == 1 else None
            return
        mine, theirs = _count(self.children[token]), _count(self.children[best])
        if mine > theirs or (mine == theirs and token < best):
            self.best = token


class SuffixTree:
    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a suffix tree needs depth >= 2; got {depth}")
        self.depth = depth
        self.root = _Node(0, 0)
        self._open: list[int] | None = None  # the text appended to
        self._active: list[_Node] = []  # nodes of the open text's suffixes shorter than depth
        self.num_nodes = 0

    # -- building --------------------------------------------------------------------------
    def open_text(self) -> list[int]:
        """Start a new text (closing the open one); append to it with append()."""
        self._open, self._active = [], []
        return self._open

    def close_text(self) -> None:
        self._open, self._active = None, []

    def append(self, token: int) -> None:
        """One more token of the open text."""
        text = self._open
        if text is None:
            raise ValueError("no open text to append to")
        position = len(text)
        text.append(token)
        self.root.count += 1
        active = []
        for node in (*self._active, self.root):
            child = node.children.get(token)
            if child is None:  # a first occurrence: from here on this suffix is unique
                node.children[token] = (text, position)
                node.child_rose(token)
                continue
            if isinstance(child, _Node):
                child.count += 1
            else:
                child = self._materialize(node, token, child)
            node.child_rose(token)
            if child.depth < self.depth:
                active.append(child)
        self._active = active

    def add_text(self, tokens: Sequence[int]) -> list[int]:
        """A whole text at once (closed afterwards); returns it, the handle remove_text takes."""
        text = self.open_text()
        for token in tokens:
            self.append(token)
        self.close_text()
        return text

    def _materialize(self, parent: _Node, token: int, ref: _Ref) -> _Node:
        """The second occurrence of parent + token: a node, holding the first occurrence's
        continuation as a reference."""
        text, position = ref
        node = _Node(2, parent.depth + 1)
        self.num_nodes += 1
        if node.depth < self.depth:
            # Always appended (the module docstring says why); a bug otherwise.
            assert position + 1 < len(text) or text is not self._open, "continuation unknown"
            if position + 1 < len(text):
                node.children[text[position + 1]] = (text, position + 1)
                node.best = text[position + 1]
        parent.children[token] = node
        return node

    def remove_text(self, text: list[int]) -> None:
        """Take a closed text's occurrences out of the counts."""
        if text is self._open:
            raise ValueError("cannot remove the open text")
        for start in range(len(text)):
            self.root.count -= 1
            node = self.root
            for position in range(start, min(start + self.depth, len(text))):
                token = text[position]
                child = node.children[token]
                node.best = None  # a count below falls: found again when read
                if not isinstance(child, _Node):  # this occurrence's own reference
                    del node.children[token]
                    break
                child.count -= 1
                if not child.count:  # nothing else below occurs anywhere
                    del node.children[token]
                    self.num_nodes -= self._size(child)
                    break
                node = child

    @staticmethod
    def _size(node: _Node) -> int:
        return 1 + sum(SuffixTree._size(c) for c in node.children.values() if isinstance(c, _Node))

    # -- reading -----------------------------------------------------------------------------
    def find(self, tokens: Sequence[int]) -> _Node | _Ref | None:
        """Where the substring `tokens` (1 to depth of them) is: its node, a reference to its
        one occurrence (the reference's position is the substring's last token), or None."""
        node: _Node | _Ref = self.root
        for token in tokens:
            if isinstance(node, _Node):
                child = node.children.get(token)
                if child is None:
                    return None
                node = child
            else:
                text, position = node
                if position + 1 >= len(text) or text[position + 1] != token:
                    return None
                node = (text, position + 1)
        return node

    def count(self, tokens: Sequence[int]) -> int:
        found = self.find(tokens)
        return 0 if found is None else found.count if isinstance(found, _Node) else 1

    def continuations(self, tokens: Sequence[int]) -> dict[int, int]:
        """The tokens that follow `tokens` somewhere, with how often (a substring shorter than depth)."""
        found = self.find(tokens)
        if found is None or len(tokens) >= self.depth:
            return {}
        return dict(_children(found))

    @property
    def open_text_tokens(self) -> list[int] | None:
        return self._open

    @property
    def open_suffix_nodes(self) -> list[_Node]:
        """The nodes of the open text's suffixes (those seen before, shorter than depth)."""
        return self._active

    # -- proposing -----------------------------------------------------------------------------
    def speculate(self, start: _Node | _Ref, match_len: int, max_tokens: int,
                  min_prob: float) -> tuple[list[int], float]:
        """From the substring at `start` (of match_len tokens): the greedy most-frequent walk
        of at most max_tokens tokens, and its score (the module's rule)."""
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        node = start
        while len(tokens) < max_tokens:
            if isinstance(node, _Node):
                best = _best_child(node)
                if best is None:
                    break
                token, child = best
                prob *= (child.count if isinstance(child, _Node) else 1) / node.count
            else:
                text, position = node
                if position + 1 >= len(text):
                    break
                token, child = text[position + 1], (text, position + 1)
            if prob < min_prob:
                break
            tokens.append(token)
            score += prob
            node = child
        return tokens, score


def _children(node: _Node | _Ref):
    """(token, count) of each continuation of a node or of a reference's occurrence."""
    if isinstance(node, _Node):
        for token, child in node.children.items():
            yield token, child.count if isinstance(child, _Node) else 1
    else:
        text, position = node
        if position + 1 < len(text):
            yield text[position + 1], 1


def _count(child: _Node | _Ref) -> int:
    return child.count if isinstance(child, _Node) else 1


def _best_child(node: _Node) -> tuple[int, _Node | _Ref] | None:
    if node.best is None:
        if not node.children:
            return None
        node.best = max(node.children, key=lambda t: (_count(node.children[t]), -t))
    return node.best, node.children[node.best]


def _score_bound(start: _Node | _Ref, cap: int) -> float:
    """At least the score of any proposal of cap tokens from `start`: each of its terms is at most
    the first token's probability (products only fall), padded for rounding in the sum."""
    if not isinstance(start, _Node):
        return float(cap) + 1e-9
    best = _best_child(start)
    first = _count(best[1]) / start.count if best is not None else 0.0
    return cap * first * (1 + 1e-9) + 1e-12


class _Proposal:
    __slots__ = ("tokens", "score", "match_len", "tree_rank")

    def __init__(self, tokens: list[int], score: float, match_len: int, tree_rank: int) -> None:
        self.tokens, self.score, self.match_len, self.tree_rank = tokens, score, match_len, tree_rank

    def key(self) -> tuple:
        return (self.score, self.match_len, -self.tree_rank)


class SuffixProposer:
    def __init__(self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        """The settings' meaning and defaults: SpeculativeConfig's suffix_decoding_* fields."""
        self.depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._local: dict[str, _LocalTree] = {}
        self.shared = SuffixTree(max_tree_depth)
        self._cached: OrderedDict[str, list[int]] = OrderedDict()  # request id -> its output text

    def propose(self, sequences: Sequence[SequenceTokens], max_tokens: Sequence[int]) -> list[list[int]]:
        check_max_tokens(sequences, max_tokens)
        proposals = []
        for seq, k in zip(sequences, max_tokens):
            if k <= 0:
                proposals.append([])
                continue
            local = self._local.get(seq.request_id)
            if local is None:
                local = self._local[seq.request_id] = _LocalTree(self.depth, seq.num_prompt_tokens)
            local.sync(seq.token_ids)
            proposals.append(self._best(local, seq.token_ids, k))
        return proposals

    def forget(self, request_id: str) -> None:
        """The request is done: its own tree goes, its output joins the shared tree."""
        local = self._local.pop(request_id, None)
        if local is None or not self.max_cached_requests:
            return
        output = local.tree.open_text_tokens[local.num_prompt_tokens:]
        if not output:
            return
        if request_id in self._cached:  # the same id again (a retried request): the newer output
            self.shared.remove_text(self._cached.pop(request_id))
        self._cached[request_id] = self.shared.add_text(output)
        while len(self._cached) > self.max_cached_requests:
            _, text = self._cached.popitem(last=False)
            self.shared.remove_text(text)

    def _best(self, local: _LocalTree, tokens: list[int], k: int) -> list[int]:
        length = len(tokens)
        longest = min(length, self.depth - 1)
        # The sequence's own tree: its suffixes seen before are the open text's nodes.
        starts: dict[int, list] = {}
        for node in local.tree.open_suffix_nodes:
            starts.setdefault(node.depth, []).append((0, local.tree, node))
        best: _Proposal | None = None
        shared = self.shared if self._cached else None
        for m in range(longest, 0, -1):
            if best is not None and best.score >= min(k, int(m * self.max_spec_factor)):
                break  # no match this short or shorter can score more
            cap = min(k, int(m * self.max_spec_factor), self.depth - m)
            if cap <= 0:
                continue
            candidates = list(starts.get(m, ()))
            if shared is not None:
                found = shared.find(tokens[length - m:])
                if found is not None:
                    candidates.append((1, shared, found))
            for rank, tree, start in candidates:
                if best is not None and _score_bound(start, cap) <= best.score:
                    continue  # cannot beat it (and a tie goes to the longer match already found)
                proposal, score = tree.speculate(start, m, cap, self.min_token_prob)
                if not proposal:
                    continue
                candidate = _Proposal(proposal, score, m, rank)
                if best is None or candidate.key() > best.key():
                    best = candidate
        return best.tokens if best is not None else []


class _LocalTree:
    """A sequence's own tree, kept in step with its tokens."""

    def __init__(self, depth: int, num_prompt_tokens: int) -> None:
        self.tree = SuffixTree(depth)
        self.tree.open_text()
        self.num_prompt_tokens = num_prompt_tokens

    def sync(self, token_ids: list[int]) -> None:
        text = self.tree.open_text_tokens
        if len(token_ids) < len(text) or (text and token_ids[len(text) - 1] != text[-1]):
            # Not an extension of what was seen (cannot happen to a request): start over.
            self.tree = SuffixTree(self.tree.depth)
            text = self.tree.open_text()
        for token in token_ids[len(text):]:
            self.tree.append(token)
