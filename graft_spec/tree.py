"""Batched draft trees in parents form, and the EAGLE-2/3 rerank that produces them.

A tree batch is ``tokens[B, N]`` int64 plus ``parents[B, N]`` int64 with
``parents[:, 0] == -1`` (node 0 is the root: the last verified token, i.e. the bonus
token of the previous step) and ``0 <= parents[b, i] < i`` for ``i >= 1`` (topological
order: a parent always has a smaller index than its children). Every row has exactly
N nodes; unused budget is filled with padding nodes (`SOURCE_PADDING`) so the verify
forward has a fixed shape.

Derived structures (all pure torch, no Python loop over nodes, device-agnostic):

* `ancestor_mask` -> ``bool[B, N, N]``: row i is True at i and at every ancestor of i
  (SGLang's tree mask, eagle_utils.py:138 build_tree_kernel_efficient).
* `node_depths` -> ``int64[B, N]`` (root 0); positions are ``seq_len + depth``.
* `sibling_links` -> SGLang's ``retrive_next_token`` (first child) and
  ``retrive_next_sibling`` (next sibling by increasing index), -1 terminated.
* `node_paths` -> root-first index path of every node (EAGLE's retrieve indices are the
  rows of leaves, `leaf_mask`).
* `parents_from_mask` inverts `ancestor_mask` (for engines that hand us a mask, e.g.
  SGLang's NGRAM corpus, ngram_worker.py).

`eagle_rerank` turns the per-step lists of SGLang's ``select_top_k_tokens``
(spec_utils.py:474) into a `DraftTree`; `eagle_step` produces the same lists for an
engine that drafts the tree itself (the vLLM proposer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .sources import SOURCE_DRAFT

__all__ = [
    "DraftTree", "node_depths", "ancestor_mask", "sibling_links", "parents_from_mask",
    "node_paths", "leaf_mask", "has_duplicate_siblings", "validate_parents",
    "path_min", "pointer_jumps", "sentinel_parents", "pointer_rounds", "order_key", "top_mask", "eagle_rerank", "eagle_step",
    "HASH_MIX", "HASH_ADD", "HASH_POW",
    "tree_from_selection", "on_path_from_accept_index",
]



def pointer_rounds(n: int) -> int:
    """Pointer-jumping rounds that cover any path in an n-node tree: ceil(log2 n), at least 1.

    Every pointer-jumping loop in graft_spec runs a number of rounds fixed by this (`pointer_jumps`
    builds this many arrays; no early exit), so the same code runs on CPU and on accelerators
    without a host read per round.
    """
    return max(1, math.ceil(math.log2(max(n, 2))))


def sentinel_parents(parents: torch.Tensor) -> torch.Tensor:
    """Parents with one extra sentinel column: ``int64[B, N + 1]``, root -> N, N -> N.

    Pointer jumping over this array needs no masking: a pointer that passed the root
    sits on the sentinel, whose value is the neutral element of the reduction.
    """
    b, n = parents.shape
    p = torch.where(parents < 0, n, parents)
    return torch.cat([p, torch.full((b, 1), n, dtype=p.dtype, device=p.device)], dim=1)


def pointer_jumps(parents: torch.Tensor) -> list[torch.Tensor]:
    """The pointer-jumping arrays of a tree, shared by every reduction over its root paths.

    ``[p, p o p, ..., p^(2^(R-1))]`` with ``p`` = `sentinel_parents` and R = ``pointer_rounds(N + 1)``:
    entry k maps each node to its 2**k-th ancestor (the sentinel past the root). `node_depths`,
    `path_min` and `ancestor_mask` take it, so several reductions over one tree pay for the
    pointers once (R - 1 gathers and the sentinel's 3 ops per tree, a kernel each on a GPU).

    Args:
        parents: ``int64[B, N]``, -1 for the root, parent index < child index.
    Returns:
        R tensors ``int64[B, N + 1]``.
    """
    p = sentinel_parents(parents)
    jumps = [p]
    for _ in range(pointer_rounds(parents.shape[1] + 1) - 1):
        p = p.gather(1, p)
        jumps.append(p)
    return jumps


def node_depths(parents: torch.Tensor, jumps: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
    """Depth of every node (root = 0) by pointer jumping, <= ceil(log2 N) rounds.

    Args:
        parents: ``int64[B, N]``, -1 for the root, parent index < child index.
        jumps: `pointer_jumps` of ``parents`` when the caller shares them (else computed here).
    Returns:
        ``int64[B, N]``.
    """
    b, n = parents.shape
    d = torch.ones(b, n + 1, dtype=torch.int64, device=parents.device)   # nodes from i up to p[i], excl.
    d[:, n].fill_(0)
    for p in jumps if jumps is not None else pointer_jumps(parents):
        d = d + d.gather(1, p)
    return d[:, :n] - 1


def path_min(values: torch.Tensor, parents: torch.Tensor, jumps: Optional[list[torch.Tensor]] = None
             ) -> torch.Tensor:
    """Minimum of ``values`` over each node's root path (node included, root included).

    Used to make scores monotone along paths so that "top-K by score, ties by lower
    index" is always ancestor-closed (paper Sec. 3.3; EAGLE reranking relies on the same
    property, eagle_utils.py:100). Several value sets over the same tree share one pointer
    jumping (stack them on leading dimensions): 2 ops per set and round.

    Args:
        values: ``float[..., B, N]``; parents: ``int64[B, N]`` (-1 = no parent).
        jumps: `pointer_jumps` of ``parents`` when the caller shares them (else computed here).
    Returns:
        ``float[..., B, N]``.
    """
    b, n = parents.shape
    lead = tuple(values.shape[:-2])
    m = torch.cat([values, values.new_full((*lead, b, 1), math.inf)], dim=-1)
    for p in jumps if jumps is not None else pointer_jumps(parents):
        m = torch.minimum(m, m.gather(-1, p.expand(*lead, b, n + 1)))
    return m[..., :n]


IDX_BITS = 20  #: low bits of `order_key` holding the (inverted) column index
#: Constants of the int64 polynomial token hashes (kernels/select.py `path_hashes`, retrieval/output_ring.py):
#: a token (or tag) enters as ``x * HASH_MIX + HASH_ADD``, a sequence as ``h * HASH_POW + x``.
HASH_MIX = -7046029254386353131        # 0x9E3779B97F4A7C15 as int64
HASH_ADD = 0x632BE59BD9B4E019
HASH_POW = 0x5851F42D4C957F2D          # odd 63-bit multiplier


def order_key(values: torch.Tensor) -> torch.Tensor:
    """Unique, order-preserving int64 key: larger value first, ties -> lower index first.

    The float32 bit pattern is mapped to a monotone integer and the (inverted) column
    index is appended in the low 20 bits, so ``topk`` on the key is a stable
    descending selection (no sort needed).
    NaN counts as -inf.

    Args:
        values: ``float[B, U]`` with U < 2**20.
    Returns:
        ``int64[B, U]``.
    """
    u = values.shape[1]
    v = torch.nan_to_num(values.float(), nan=-math.inf).contiguous()
    bits = v.view(torch.int32).to(torch.int64)
    mono = torch.where(bits < 0, -(2 ** 31) - bits, bits)
    idx = torch.arange(u, device=values.device)
    return mono * (1 << IDX_BITS) + ((1 << IDX_BITS) - 1 - idx)


def top_mask(key: torch.Tensor, k: "int | torch.Tensor", kmax: Optional[int] = None) -> torch.Tensor:
    """``bool[B, U]``: the ``k`` largest entries per row of a unique key (see `order_key`).

    Args:
        key: ``int64[B, U]`` unique per row.
        k: int, or ``int64[B]`` per-row counts.
        kmax: static upper bound of ``k``; required when ``k`` is a tensor.
    Raises:
        ValueError: ``k`` is a tensor and ``kmax`` is None.
    """
    b, u = key.shape
    if kmax is None:
        if isinstance(k, torch.Tensor):
            raise ValueError("top_mask: per-row counts need kmax (a static bound, no host read)")
        kmax = int(k)
    kmax = min(kmax, u)
    if kmax <= 0:
        return torch.zeros(b, u, dtype=torch.bool, device=key.device)
    vals = key.topk(kmax, dim=1).values
    if not isinstance(k, torch.Tensor):
        return key >= vals[:, kmax - 1:kmax]
    kk = k.to(torch.int64).clamp(max=kmax)
    kth = vals.gather(1, (kk - 1).clamp(min=0)[:, None])
    return (key >= kth) & (kk > 0)[:, None]


def ancestor_mask(parents: torch.Tensor, jumps: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
    """Tree attention mask: ``mask[b, i, j]`` is True iff j == i or j is an ancestor of i.

    Row doubling: the rows start with distances 0 and 1; OR-ing in the row of the 2**k-th
    ancestor (k = 1 .. R-1 of `pointer_jumps`) extends them to distances < 2**(k+1), and
    2**R >= N + 1 covers every path. Matches SGLang's QLEN_ONLY tree mask layout
    (eagle_utils.py:138).

    Args:
        parents: ``int64[B, N]``.
        jumps: `pointer_jumps` of ``parents`` when the caller shares them (else computed here).
    Returns:
        ``bool[B, N, N]``.
    """
    b, n = parents.shape
    jumps = jumps if jumps is not None else pointer_jumps(parents)
    ar = torch.arange(n + 1, device=parents.device)
    p = jumps[0]                                                        # [B, N+1]
    # rows over N+1 columns; the sentinel row/column stays False
    mask = (ar[None, :, None] == ar[None, None, :]) | (p[:, :, None] == ar[None, None, :])
    mask[:, :, n].fill_(False)
    mask[:, n, :].fill_(False)
    if len(jumps) > 1:   # whole rows by flat row id (a row gather, not an element-wise [B, N+1, N+1] one)
        rows = torch.stack(jumps[1:]) + torch.arange(0, b * (n + 1), n + 1, device=parents.device)[:, None]
        flat = mask.view(b * (n + 1), n + 1)
        for anc in rows:
            flat |= flat.index_select(0, anc.reshape(-1))
    return mask[:, :n, :n]


def chain_links(next_token: torch.Tensor, next_sibling: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `sibling_links`: from first-child / next-sibling links, ``(parent, rank, prev)``
    ``int64[B, N]`` of every node: the node whose child chain holds it (-1 for the root and for
    nodes no link reaches), its position in that chain (0 = first child) and its previous sibling
    (-1 for a first child). List ranking by pointer jumping, `pointer_rounds` rounds, no host read.

    Args:
        next_token / next_sibling: ``int[B, N]``, -1 terminated (SGLang's ``retrive_next_*``).
    """
    b, n = next_token.shape
    dev = next_token.device
    ar = torch.arange(n, device=dev).expand(b, n)
    nt, ns = next_token.to(torch.int64), next_sibling.to(torch.int64)
    prev = torch.full((b, n + 1), -1, dtype=torch.int64, device=dev).scatter_(
        1, torch.where(ns >= 0, ns, n), ar)[:, :n]
    first_of = torch.full((b, n + 1), -1, dtype=torch.int64, device=dev).scatter_(
        1, torch.where(nt >= 0, nt, n), ar)[:, :n]
    jump = torch.where(prev >= 0, prev, ar)            # chain heads point at themselves (rank 0)
    rank = (prev >= 0).to(torch.int64)
    for _ in range(pointer_rounds(n)):
        rank = rank + rank.gather(1, jump)
        jump = jump.gather(1, jump)
    return first_of.gather(1, jump), rank, prev


def sibling_links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child / next-sibling arrays, children in increasing index order.

    Same contract as SGLang's ``retrive_next_token`` / ``retrive_next_sibling``
    (kernels/jit/include/sgl_kernel/speculative/eagle.cuh, build_tree_efficient).

    Args:
        parents: ``int64[B, N]``.
    Returns:
        ``(first_child int64[B, N], next_sibling int64[B, N])``, -1 where none.
    """
    b, n = parents.shape
    dev = parents.device
    parents = parents.to(torch.int64)   # scatter indices (a no-op for int64)
    ar = torch.arange(n, device=dev).expand(b, n)
    first = torch.full((b, n + 1), n, dtype=torch.int64, device=dev).scatter_reduce_(
        1, torch.where(parents >= 0, parents, n), ar, reduce="amin", include_self=True)[:, :n]
    # siblings are neighbours when the nodes are sorted by parent (stable: by index within one parent)
    order = torch.argsort(parents, dim=1, stable=True)
    by_parent = parents.gather(1, order)
    after = torch.where(by_parent[:, 1:] == by_parent[:, :-1], order[:, 1:], -1)
    nxt = torch.empty_like(order).scatter_(1, order, torch.cat([after, after.new_full((b, 1), -1)], 1))
    nxt[:, 0].fill_(-1)  # the root has no siblings
    return torch.where(first == n, -1, first), nxt


def parents_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Invert `ancestor_mask`: the parent is the ancestor with the largest index < i.

    Args:
        mask: ``bool[B, N, N]`` ancestor mask of a topologically ordered tree.
    Returns:
        ``int64[B, N]``, -1 for the root (and for any row without ancestors).
    """
    n = mask.shape[-1]
    ar = torch.arange(n, device=mask.device)
    strict = mask & (ar[None, None, :] < ar[None, :, None])
    return torch.where(strict, ar[None, None, :], torch.full((), -1, device=mask.device)).amax(dim=2)


def node_paths(parents: torch.Tensor, max_depth: Optional[int] = None,
               mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Root-first index path of every node, -1 padded.

    Args:
        parents: ``int64[B, N]``.
        max_depth: deepest node depth; computed (one host sync) when None.
        mask: precomputed `ancestor_mask` (optional).
    Returns:
        ``int64[B, N, max_depth + 1]``; ``paths[b, i, :depth_i + 1]`` lists root .. i.
        EAGLE's ``retrieve_indices`` are the rows where `leaf_mask` is True.
    """
    n = parents.shape[1]
    if mask is None:
        mask = ancestor_mask(parents)
    if max_depth is None:
        max_depth = int(node_depths(parents).max().item())
    ar = torch.arange(n, device=parents.device)
    keyed = torch.where(mask, ar, torch.full((), n, device=parents.device))
    srt = keyed.sort(dim=2).values[:, :, : max_depth + 1]
    return torch.where(srt == n, -1, srt)


def leaf_mask(parents: torch.Tensor) -> torch.Tensor:
    """``bool[B, N]``: True for nodes without children."""
    b, n = parents.shape
    has_child = torch.zeros(b, n + 1, dtype=torch.bool, device=parents.device)
    has_child.scatter_(1, torch.where(parents >= 0, parents, n), True)
    return ~has_child[:, :n]


def has_duplicate_siblings(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """``bool[B]``: True where two children of one node carry the same token.

    Distinct siblings are required for lossless target-only rejection sampling
    (reference landscape §4, condition (a)).
    """
    n = parents.shape[1]
    ar = torch.arange(n, device=parents.device)
    dup = ((parents[:, :, None] == parents[:, None, :]) & (tokens[:, :, None] == tokens[:, None, :])
           & (ar[None, :, None] < ar[None, None, :]))
    dup &= (parents >= 0)[:, :, None]
    return dup.flatten(1).any(dim=1)


def validate_parents(parents: torch.Tensor) -> None:
    """Raise ValueError unless ``parents`` is a batch of topologically ordered trees."""
    if parents.dim() != 2 or parents.dtype != torch.int64:
        raise ValueError(f"parents must be int64[B, N], got {parents.dtype} {tuple(parents.shape)}")
    n = parents.shape[1]
    if n < 1 or bool((parents[:, 0] != -1).any()):
        raise ValueError("parents[:, 0] must be -1 (node 0 is the root)")
    ar = torch.arange(n, device=parents.device)
    rest = parents[:, 1:]
    if bool(((rest < 0) | (rest >= ar[1:])).any()):
        raise ValueError("every non-root node needs 0 <= parent < its own index")


@dataclass
class DraftTree:
    """A batch of draft trees with exactly N nodes per request.

    Attributes:
        tokens: ``int64[B, N]`` token ids; ``tokens[:, 0]`` is the root (last verified token).
        parents: ``int64[B, N]``; -1 for the root, else 0 <= parent < index.
        logp: ``float32[B, N]`` natural-log score: for draft nodes the cumulative draft
            log-probability of the path (EAGLE score), for retrieved nodes the log of the
            estimated path acceptance probability, 0 for the root, -inf for padding.
        source: ``int64[B, N]`` the node's source (graft_spec/sources.py): the winning member, or
            ``SOURCE_PADDING``.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    logp: torch.Tensor
    source: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def mask(self) -> torch.Tensor:
        """``bool[B, N, N]`` ancestor mask (see `ancestor_mask`)."""
        return ancestor_mask(self.parents)

    def depths(self) -> torch.Tensor:
        """``int64[B, N]`` node depths."""
        return node_depths(self.parents)

    def positions(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """``int64[B, N]`` position ids = ``seq_lens[:, None] + depth``.

        Args:
            seq_lens: ``int64[B]`` position of the root token (number of tokens before it).
        """
        return seq_lens.to(torch.int64)[:, None] + node_depths(self.parents)

    def links(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(first_child, next_sibling)`` (see `sibling_links`)."""
        return sibling_links(self.parents)

    def paths(self, max_depth: Optional[int] = None) -> torch.Tensor:
        """Root-first node paths (see `node_paths`)."""
        return node_paths(self.parents, max_depth)

    def validate(self) -> None:
        """Raise ValueError on bad shapes/dtypes, ordering, or duplicate siblings."""
        shape = self.tokens.shape
        for name in ("parents", "logp", "source"):
            if getattr(self, name).shape != shape:
                raise ValueError(f"DraftTree.{name} shape {tuple(getattr(self, name).shape)} "
                                 f"!= tokens shape {tuple(shape)}")
        if self.tokens.dtype != torch.int64:
            raise ValueError("DraftTree.tokens must be int64")
        validate_parents(self.parents)
        if bool(has_duplicate_siblings(self.tokens, self.parents).any()):
            raise ValueError("DraftTree has duplicate sibling tokens")

    def to(self, device: torch.device | str) -> "DraftTree":
        return DraftTree(self.tokens.to(device), self.parents.to(device),
                         self.logp.to(device), self.source.to(device))

    def row(self, b: int) -> "DraftTree":
        """Request ``b`` as a batch of one (debugging, tests)."""
        return DraftTree(self.tokens[b:b + 1], self.parents[b:b + 1],
                         self.logp[b:b + 1], self.source[b:b + 1])


# --------------------------------------------------------------------------- EAGLE
#
# Index convention (SGLang spec_utils.py:474 select_top_k_tokens, eagle_utils.py:100
# organize_draft_results, eagle.cuh build_tree_efficient). Per request, the candidate
# ("global") index space has S = topk + (steps - 1) * topk**2 entries:
#   * step 0: entries 0 .. topk-1 are the root's top-k children;
#     scores_0 = topk_p  [B, 1, topk] (or [B, topk]); tokens_0 [B, topk];
#     parents_0 = arange(-1, topk)  [B, topk + 1]  (entry 0 is -1 = root).
#   * step i >= 1: entries topk + (i-1)*topk**2 + f*topk + c for frontier slot f and
#     child c; scores_i = frontier_score[:, f, None] * p(child)  [B, topk, topk] (the
#     *cumulative* path probability); tokens_i [B, topk**2]; parents_i [B, topk] = the
#     global indices of the topk entries of step i chosen as the next frontier.
#   * parent rule: for global index g, tb = g // topk; tb == 0 -> the root, otherwise
#     the parent is global index parent_list[tb] with
#     parent_list = cat(parents_0 .. parents_{steps-2}) [B, 1 + topk*(steps-1)].
#     (parents_{steps-1} is never used.)


def _global_parents(parents_per_step: Sequence[torch.Tensor], topk: int, s: int,
                    b: int, device: torch.device) -> torch.Tensor:
    """Parent global index (-1 = root) of every global index, ``int64[B, S]``."""
    if len(parents_per_step) > 1:
        plist = torch.cat([p.reshape(b, -1) for p in parents_per_step[:-1]], dim=1).to(torch.int64)
    else:
        plist = torch.full((b, 1), -1, dtype=torch.int64, device=device)
    tb = torch.arange(s, device=device) // topk
    gp = plist.gather(1, tb.clamp(max=plist.shape[1] - 1).expand(b, s))
    return torch.where(tb == 0, -1, gp)


def eagle_rerank(scores_per_step: Sequence[torch.Tensor],
                 tokens_per_step: Sequence[torch.Tensor],
                 parents_per_step: Sequence[torch.Tensor],
                 root_tokens: torch.Tensor,
                 num_nodes: int) -> DraftTree:
    """EAGLE-2/3 rerank: root + the best ``num_nodes - 1`` draft candidates.

    Takes the lists exactly as SGLang's ``select_top_k_tokens`` appends them (see the
    index convention above) and keeps the global top ``num_nodes - 1`` cumulative
    scores, sorted by global index (so parents precede children), like
    ``organize_draft_results`` + ``build_tree_kernel_efficient``. Differences, both
    deliberate: scores are first made monotone along paths (NaN -> -inf) and ties are
    broken by lower global index, so the kept set is always
    ancestor-closed (SGLang's ``torch.topk`` leaves ties unspecified); and the
    scores are kept (as ``logp``) instead of discarded.

    Args:
        scores_per_step: ``steps`` tensors of cumulative probabilities, step 0
            ``[B, 1, topk]`` or ``[B, topk]``, step i ``[B, topk, topk]``.
        tokens_per_step: ``[B, topk]`` then ``[B, topk**2]`` int64.
        parents_per_step: ``[B, topk + 1]`` then ``[B, topk]`` int64 global indices.
        root_tokens: ``int64[B]`` the root (bonus) token of every request.
        num_nodes: N, root included; 2 <= N <= 1 + S.
    Returns:
        `DraftTree` ``[B, N]``, source = draft, logp = log(cumulative prob), root logp 0.
    Raises:
        ValueError: N outside [2, 1 + S] or inconsistent step shapes.
    """
    if not (len(scores_per_step) == len(tokens_per_step) == len(parents_per_step) >= 1):
        raise ValueError("eagle_rerank: the three per-step lists must be non-empty and equally long")
    b = root_tokens.shape[0]
    device = root_tokens.device
    scores = torch.cat([s.reshape(b, -1) for s in scores_per_step], dim=1).float()
    tokens = torch.cat([t.reshape(b, -1) for t in tokens_per_step], dim=1).to(torch.int64)
    s = scores.shape[1]
    topk = tokens_per_step[0].reshape(b, -1).shape[1]
    steps = len(scores_per_step)
    if s != topk + (steps - 1) * topk * topk or tokens.shape[1] != s:
        raise ValueError(f"eagle_rerank: expected {topk + (steps - 1) * topk * topk} candidates "
                         f"for topk={topk}, steps={steps}; got scores {s}, tokens {tokens.shape[1]}")
    if not 2 <= num_nodes <= s + 1:
        raise ValueError(f"eagle_rerank: num_nodes={num_nodes} must be in [2, {s + 1}]")
    gpar = _global_parents(parents_per_step, topk, s, b, device)
    logs = torch.nan_to_num(torch.log(scores.clamp(min=0)), nan=-math.inf)
    for i in range(1, steps):  # monotone along paths; step i's parents live in step i-1
        lo = topk + (i - 1) * topk * topk
        blk = slice(lo, lo + topk * topk)
        logs[:, blk] = torch.minimum(logs[:, blk], logs.gather(1, gpar[:, blk]))
    sel = top_mask(order_key(logs), num_nodes - 1)                          # [B, S]
    rank = torch.cumsum(sel, dim=1)                                         # 1-based tree index
    dest = torch.where(sel, rank - 1, num_nodes - 1)
    sel_idx = torch.zeros(b, num_nodes, dtype=torch.int64, device=device)
    sel_idx.scatter_(1, dest, torch.arange(s, device=device).expand(b, s))
    sel_idx = sel_idx[:, : num_nodes - 1]                                   # ascending global idx
    pos = torch.where(sel, rank, -1)
    gp_sel = gpar.gather(1, sel_idx)
    par_sel = torch.where(gp_sel < 0, 0, pos.gather(1, gp_sel.clamp(min=0)))
    parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=device), par_sel], dim=1)
    toks = torch.cat([root_tokens.reshape(b, 1).to(torch.int64), tokens.gather(1, sel_idx)], dim=1)
    logp = torch.cat([torch.zeros(b, 1, device=device), logs.gather(1, sel_idx)], dim=1)
    source = torch.full((b, num_nodes), SOURCE_DRAFT, dtype=torch.int64, device=device)
    return DraftTree(toks, parents, logp, source)


def tree_from_selection(parent_list: torch.Tensor, top_scores_index: torch.Tensor,
                        draft_tokens: torch.Tensor, root_tokens: torch.Tensor, topk: int,
                        scores: Optional[torch.Tensor] = None) -> DraftTree:
    """`DraftTree` from the outputs of SGLang's ``organize_draft_results`` (eagle_utils.py:100).

    For adapters that hook in *after* SGLang's own rerank. Same parent rule as
    ``build_tree_kernel_efficient`` (tb = index // topk; tb == 0 -> root, else the node
    whose global index is ``parent_list[tb]``).

    Args:
        parent_list: ``int64[B, 1 + topk * (steps - 1)]`` (empty second dim when steps == 1).
        top_scores_index: ``int64[B, N - 1]`` selected global indices, ascending.
        draft_tokens: ``int64[B, N - 1]`` their tokens (root not included).
        root_tokens: ``int64[B]``.
        topk: EAGLE top-k.
        scores: optional ``float[B, N - 1]`` cumulative probabilities of the selected
            nodes (SGLang discards them; capture them with a sink, reference §2.5). When
            None, a rank prior ``0.5 ** (rank + 1)`` per edge (rank = index % topk) stands in
            so pruning still orders nodes sensibly.
    Returns:
        `DraftTree` ``[B, N]`` (source = draft).
    Raises:
        ValueError: a selected node whose parent was not selected (not ancestor-closed).
    """
    b, k = top_scores_index.shape
    device = top_scores_index.device
    idx = top_scores_index.to(torch.int64)
    tb = idx // topk
    if parent_list.shape[1] > 0:
        gp = parent_list.to(torch.int64).gather(1, tb.clamp(max=parent_list.shape[1] - 1))
    else:
        gp = torch.full_like(idx, -1)
    gp = torch.where(tb == 0, -1, gp)
    pos = torch.searchsorted(idx.contiguous(), gp.clamp(min=0).contiguous())
    found = idx.gather(1, pos.clamp(max=k - 1)) == gp
    if bool(((gp >= 0) & ~found).any()):
        raise ValueError("tree_from_selection: a selected node's parent is not selected")
    par = torch.where(gp < 0, 0, pos + 1)
    parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=device), par], dim=1)
    if scores is not None:
        logs = torch.nan_to_num(torch.log(scores.float().clamp(min=0)), nan=-math.inf)
    else:
        edge = -(idx % topk + 1).float() * math.log(2.0)
        logs = torch.zeros(b, k + 1, device=device)
        for _ in range(k):  # parents precede children: one sweep per level suffices; bounded
            new = torch.cat([torch.zeros(b, 1, device=device), logs.gather(1, par) + edge], dim=1)
            if torch.equal(new, logs):
                break
            logs = new
        logs = logs[:, 1:]
    logp = torch.cat([torch.zeros(b, 1, device=device), logs], dim=1)
    toks = torch.cat([root_tokens.reshape(b, 1).to(torch.int64), draft_tokens.to(torch.int64)], dim=1)
    return DraftTree(toks, parents, path_min(logp, parents),
                     torch.full((b, k + 1), SOURCE_DRAFT, dtype=torch.int64, device=device))


def eagle_step(step: int, probs_topk: torch.Tensor, tokens_topk: torch.Tensor,
               frontier_scores: Optional[torch.Tensor]
               ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
    """One EAGLE expansion step in SGLang's convention (for engines without it).

    Args:
        step: 0-based draft step.
        probs_topk: step 0 ``float[B, topk]`` (root's top-k draft probs); later
            ``float[B, topk, topk]`` (top-k of each frontier node, frontier-major).
        tokens_topk: int64 with the same shape as ``probs_topk``.
        frontier_scores: None at step 0, else ``float[B, topk]`` cumulative scores of
            the current frontier (returned by the previous call).
    Returns:
        ``((scores_i, tokens_i, parents_i), next_frontier_scores [B, topk],
        next_frontier_flat [B, topk])``: the triple to append to the per-step lists,
        the cumulative scores of the next frontier, and the flat indices (into this
        step's ``tokens_i``) of the next frontier, i.e. which nodes to run the draft
        model on next (frontier slot f of the next step = ``next_frontier_flat[:, f]``).
    """
    b = probs_topk.shape[0]
    if step == 0:
        topk = probs_topk.shape[-1]
        parents = torch.arange(-1, topk, device=probs_topk.device).expand(b, -1)
        return ((probs_topk.reshape(b, 1, topk), tokens_topk.reshape(b, topk).to(torch.int64), parents),
                probs_topk.reshape(b, topk), torch.arange(topk, device=probs_topk.device).expand(b, -1))
    topk = probs_topk.shape[-1]
    expand = frontier_scores.reshape(b, topk, 1) * probs_topk.reshape(b, topk, topk)
    best_p, best_i = torch.topk(expand.flatten(1), topk, dim=1)
    parents = best_i + (topk * topk * (step - 1) + topk)
    return ((expand, tokens_topk.reshape(b, topk * topk).to(torch.int64), parents), best_p, best_i)


def on_path_from_accept_index(accept_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Which nodes of a verified tree the target accepted, from an engine's accept index.

    Args:
        accept_index: ``int[B, W]`` SGLang-style flat node ids ``b * N + i`` of the accepted path
            in path order, -1 padded (``EagleVerifyOutput.accept_index``, eagle_info.py).
        num_nodes: N, the tree's width.
    Returns:
        ``bool[B, N]``: True at the accepted nodes (the root included).
    """
    b = accept_index.shape[0]
    base = torch.arange(b, device=accept_index.device)[:, None] * num_nodes
    local = torch.where(accept_index >= 0, accept_index.to(torch.int64) - base, num_nodes).clamp(0, num_nodes)
    out = torch.zeros(b, num_nodes + 1, dtype=torch.bool, device=accept_index.device)
    return out.scatter_(1, local, True)[:, :num_nodes]
