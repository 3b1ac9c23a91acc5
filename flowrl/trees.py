"""BranchGRPO's credit assignment on a rollout tree: reward fusion, depth-wise advantages, pruning.

All functions take a :class:`~flowrl.engine.Tree` and work per round (= depth: a node created by step i has
depth i + 1). Maths: the BranchGRPO paper (arXiv 2509.06040) and its released code.

- :func:`fuse_rewards`: a node's value from its leaves: uniform mean (beta = 0), the paper's path-probability
  weighting ``w_l ∝ exp(beta * log p_beh(l | n))``, or the released code's recursive softmax over child edges.
- :func:`depth_advantages`: ``A(n) = (rbar(n) - mean_d) / (std_d + eps)`` over the nodes of the same tree
  (root) at the same depth; 0 where a depth has one node or its std is below the threshold.
- :func:`width_prune_masks` / :func:`depth_prune_masks`: which edges keep their gradient. Pruning never
  changes the rollout or the rewards, only which edges are trained.
"""

from __future__ import annotations

import torch

from .engine import Tree


def _cumulative_log_prob(tree: Tree) -> list[torch.Tensor]:
    """Per round, the behaviour log-prob of the path from the root to each node (ODE edges add 0)."""
    cum = [torch.zeros(tree.latents[0].shape[0], dtype=torch.float64)]
    for r in range(1, tree.num_rounds + 1):
        cum.append(cum[r - 1][tree.parent[r]] + tree.log_prob[r].double())
    return cum


def fuse_rewards(tree: Tree, leaf_rewards: torch.Tensor, mode: str = "uniform", beta: float = 1.0) -> list[torch.Tensor]:
    """Leaf rewards (L,) -> fused value per node, per round (N_r,) float64. Non-finite leaves are left out."""
    leaf_rewards = leaf_rewards.double()
    if mode == "uniform" or (mode == "path_weighted" and beta == 0):
        return [v.double() for v in tree.node_values_from_leaves(leaf_rewards)]
    ok = torch.isfinite(leaf_rewards)
    if mode == "path_weighted":
        # w_l^(n) ∝ exp(beta * (cum_l - cum_n)); cum_n is shared by all l below n, so exp(beta * cum_l) suffices
        cum_leaf = tree.leaf_values(_cumulative_log_prob(tree))
        logits = torch.where(ok, beta * cum_leaf, -torch.inf)
        w = torch.exp(logits - logits[ok].max())  # a global shift cancels in every ratio
        num = tree.per_node(torch.where(ok, w * leaf_rewards, 0.0))
        den = tree.per_node(w)
        for r in range(tree.num_rounds, 0, -1):
            num[r - 1].index_add_(0, tree.parent[r], num[r])
            den[r - 1].index_add_(0, tree.parent[r], den[r])
        return [torch.where(d > 0, n / d.clamp_min(1e-300), 0.0) for n, d in zip(num, den)]
    if mode == "edge_softmax":
        # released code: rbar(n) = sum_c softmax_c(beta * logp_edge(c)) rbar(c); a single child is copied
        values = tree.per_node(torch.where(ok, leaf_rewards, 0.0))
        valid = tree.per_node(ok.double())
        for r in range(tree.num_rounds, 0, -1):
            n_up = tree.latents[r - 1].shape[0]
            logit = torch.where(valid[r] > 0, beta * tree.log_prob[r].double(), -torch.inf)
            top = torch.full((n_up,), -torch.inf, dtype=torch.float64).scatter_reduce(0, tree.parent[r], logit, "amax")
            w = torch.where(valid[r] > 0, torch.exp(logit - top[tree.parent[r]]), 0.0)
            num = torch.zeros(n_up, dtype=torch.float64).index_add_(0, tree.parent[r], w * values[r])
            den = torch.zeros(n_up, dtype=torch.float64).index_add_(0, tree.parent[r], w)
            internal = torch.zeros(n_up, dtype=torch.bool)
            internal[tree.parent[r]] = True
            values[r - 1] = torch.where(internal, torch.where(den > 0, num / den.clamp_min(1e-300), 0.0), values[r - 1])
            valid[r - 1] = torch.where(internal, (den > 0).double(), valid[r - 1])
        return values
    raise ValueError(f"unknown fusion {mode!r}; choose uniform, path_weighted or edge_softmax")


def depth_advantages(tree: Tree, values: list[torch.Tensor], ddof: int = 1, eps: float = 1e-8,
                     zero_std_threshold: float = 1e-6) -> tuple[list[torch.Tensor], dict]:
    """Z-score of the fused values among the nodes of one prompt at one depth: with one tree per prompt the
    paper's per-(tree, depth) statistics; with several trees per prompt (BranchGRPO's ``trees_per_prompt``) the
    nodes of all of them, so a small branch factor still gives graded advantages. Returns per-round (N_r,)
    float32 advantages and counts of (prompt, depth) groups that were all equal (zero advantage on purpose)."""
    adv = [torch.zeros(v.shape[0]) for v in values]
    groups = zero = 0
    for r in range(1, tree.num_rounds + 1):
        prompts = tree.group[r]
        for prompt in prompts.unique().tolist():
            m = prompts == prompt
            v = values[r][m]
            if v.numel() <= 1:
                continue
            groups += 1
            std = v.std(correction=ddof) if v.numel() > ddof else torch.zeros((), dtype=v.dtype)
            if std < zero_std_threshold:
                zero += 1
                continue
            adv[r][m] = ((v - v.mean()) / (std + eps)).float()
    return adv, {"depth_groups": groups, "depth_groups_zero_std": zero}


def _chain_ids(tree: Tree, split_round: int) -> list[torch.Tensor]:
    """For rounds after ``split_round``: the position (in round ``split_round``) of each node's ancestor
    created by the last split, i.e. which post-split chain the node is on. -1 for earlier rounds."""
    ids = [torch.full((x.shape[0],), -1) for x in tree.latents]
    if split_round > tree.num_rounds:
        return ids
    ids[split_round] = torch.arange(tree.latents[split_round].shape[0])
    for r in range(split_round + 1, tree.num_rounds + 1):
        ids[r] = ids[r - 1][tree.parent[r]]
    return ids


def width_prune_masks(tree: Tree, last_split: int, mode: str, values: list[torch.Tensor], adv: list[torch.Tensor],
                      leaf_rewards: torch.Tensor, ratio: float = 0.5, extreme_b: int = 0) -> list[torch.Tensor]:
    """Per round, True where the edge into the node keeps its gradient. Only post-split edges (parent step
    > ``last_split``, i.e. child round >= last_split + 2) can be pruned.

    - ``parent_top1`` (paper): for each parent at the last split keep only the post-split chain of its child
      with the higher fused value.
    - ``extreme``: per tree keep the chains of the ``extreme_b`` best and worst leaves (0: a quarter of the leaves).
    - ``chain_ratio`` (released code, mode 1): in each chain keep the top ``ratio`` of edges by advantage.
    - ``global_ratio`` (released code, mode 2): per tree keep the top and bottom ``ratio / 2`` of post-split
      edges by advantage.
    """
    keep = [torch.ones(x.shape[0], dtype=torch.bool) for x in tree.latents]
    if mode == "none":
        return keep
    split_round = last_split + 1  # nodes created by the last split
    chains = _chain_ids(tree, split_round)
    post = range(split_round + 1, tree.num_rounds + 1)
    if mode in ("parent_top1", "extreme"):
        n_chain = tree.latents[split_round].shape[0] if split_round <= tree.num_rounds else 0
        chain_keep = torch.zeros(n_chain, dtype=torch.bool)
        if mode == "parent_top1":
            par = tree.parent[split_round]
            for p in par.unique().tolist():
                kids = torch.nonzero(par == p).flatten()
                chain_keep[kids[values[split_round][kids].argmax()]] = True
        else:
            leaf_chain = tree.leaf_values(chains)
            leaf_root = tree.leaf_root
            for root in leaf_root.unique().tolist():
                m = torch.nonzero((leaf_root == root) & torch.isfinite(leaf_rewards)).flatten()
                b = extreme_b or max(1, m.numel() // 4)
                order = m[leaf_rewards[m].double().argsort()]
                chain_keep[leaf_chain[torch.cat([order[:b], order[-b:]])]] = True
        for r in post:
            keep[r] = chain_keep[chains[r]]
        return keep
    if mode == "chain_ratio":
        for c in range(tree.latents[split_round].shape[0] if split_round <= tree.num_rounds else 0):
            members = [(r, p) for r in post for p in torch.nonzero(chains[r] == c).flatten().tolist()]
            _keep_top(keep, adv, members, ratio, both_ends=False)
        return keep
    if mode == "global_ratio":
        for root in tree.root[0].tolist():
            members = [(r, p) for r in post for p in torch.nonzero(tree.root[r] == root).flatten().tolist()]
            _keep_top(keep, adv, members, ratio, both_ends=True)
        return keep
    raise ValueError(f"unknown width pruning {mode!r}")


def _keep_top(keep, adv, members, ratio: float, both_ends: bool) -> None:
    """Among ``members`` [(round, pos)], keep round(ratio * n) by advantage (the top, or half top half bottom)."""
    if not members:
        return
    a = torch.stack([adv[r][p] for r, p in members])
    n_keep = int(round(ratio * len(members)))
    order = torch.argsort(a, descending=True, stable=True).tolist()
    chosen = set(order[: n_keep // 2] + order[len(order) - (n_keep - n_keep // 2):]) if both_ends else set(order[:n_keep])
    for k, (r, p) in enumerate(members):
        keep[r][p] = k in chosen


def depth_window(initial: list[int], iteration: int, slide_every: int, stop_depth: int) -> list[int]:
    """The released code's sliding depth window: D_t = D_0 - min(iteration // slide_every, min(D_0) - stop)."""
    if not initial:
        return []
    shift = min(iteration // max(slide_every, 1), max(min(initial) - stop_depth, 0))
    return [d - shift for d in initial]


def depth_prune_masks(tree: Tree, depths: list[int]) -> list[torch.Tensor]:
    """True where the edge into the node keeps its gradient: edges whose child depth is in ``depths`` are cut."""
    return [torch.full((x.shape[0],), r not in depths, dtype=torch.bool) for r, x in enumerate(tree.latents)]
