"""CAPI's targets and loss (Darcet et al., "Cluster and Predict Latent Patches for Improved
Masked Image Modeling", TMLR 2025): the teacher's patch features assigned to online clusters
by a position-wise Sinkhorn-Knopp, and the cross-entropy of a prediction against those
assignments.

Position-wise: the assignments of the tokens at one position (row, col) are balanced over
the images that have it, each position on its own (the paper's answer to positional
collapse), then each token's row is normalised over the clusters. With every image of one
grid this is lightly's and the official `sinkhorn_knopp`; at native resolution, images of
other grids share the positions they have in common (`positions`: each token's index in a
grid that holds every image's, the same on every rank).

Shapes: T tokens (of every image of the batch, packed), K clusters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_vit.pretrain.distillation_losses import _all_reduce, _world


@torch.no_grad()
def positionwise_sinkhorn(logits: torch.Tensor, positions: torch.Tensor, count: int,
                          temperature: float, iterations: int = 3, *,
                          distributed: bool = True, epsilon: float = 1e-8) -> torch.Tensor:
    """The teacher's soft assignments (`[T, K]`, each row a distribution over the clusters).

    Args:
        logits: the clustering head's logits `[T, K]`.
        positions: `[T]`, each token's position in `[0, count)`.
        count: how many positions there are (the same on every rank).
        temperature: the teacher temperature (CAPI: 0.06).
        iterations: Sinkhorn iterations (CAPI: 3).
        distributed: sum and maximise over every rank when `torch.distributed` runs with
            more than one.
        epsilon: added to each denominator, as CAPI does.
    """
    if logits.ndim != 2 or positions.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [T, K] and positions [T], got "
                         f"{list(logits.shape)} and {list(positions.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    reduce = _world(distributed, None)
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    index = positions[:, None].expand_as(scores)
    shift = scores.new_full((count, scores.shape[1]), float("-inf"))
    shift = _all_reduce(shift.scatter_reduce(0, index, scores, "amax"), reduce, None,
                        maximum=True)
    q = torch.exp(scores - shift[positions])  # each (position, cluster) shifted by its max
    for _ in range(iterations):
        over_batch = _all_reduce(scores.new_zeros(count, scores.shape[1]).index_add_(
            0, positions, q), reduce, None)
        q = q / (over_batch[positions] + epsilon)
        q = q / (q.sum(dim=1, keepdim=True) + epsilon)
    return q


def cluster_cross_entropy(logits: torch.Tensor, assignments: torch.Tensor,
                          temperature: float) -> torch.Tensor:
    """The mean over tokens of `-sum_k assignments * log_softmax(logits / temperature)`
    (CAPI's student loss, at 0.12; and its clustering loss, the clustering head's own logits
    against their assignments)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    log_probabilities = F.log_softmax(logits.to(dtype) / temperature, dim=-1)
    return -(assignments * log_probabilities).sum(dim=-1).mean()
