"""The losses of DINOv2 (Oquab et al., "DINOv2: Learning Robust Visual Features without
Supervision", TMLR 2024): teacher targets by centering (DINO, Caron et al. 2021) or
Sinkhorn-Knopp (SwAV, Caron et al. 2020), the image-level DINO cross-entropy, iBOT's masked
patch cross-entropy (Zhou et al. 2022) and the KoLeo regulariser (Sablayrolles et al. 2019).

Targets and losses are separate functions: the objective makes the teacher's targets
(`softmax_center` or `sinkhorn_knopp`), then updates the `Center` with the teacher's logits,
then computes the losses. The references (DINOv2's and lightly's loss modules) update the
center inside the loss's forward; here no loss has a side effect, so a loss can be evaluated
twice (e.g. for logging) without moving the center.

Shapes: B images per view, K prototypes (the head's `out_dim`), M masked tokens in the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import distributed as dist
from torch import nn


def _world(distributed: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether sums must be all-reduced: asked for, initialised, and more than one rank."""
    return (distributed and dist.is_available() and dist.is_initialized()
            and dist.get_world_size(group) > 1)


def _all_reduce(tensor: torch.Tensor, reduce: bool, group: dist.ProcessGroup | None,
                maximum: bool = False) -> torch.Tensor:
    """Sums (or takes the maximum of) `tensor` over the ranks in place when `reduce`."""
    if reduce:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM,
                        group=group)
    return tensor


@torch.no_grad()
def sinkhorn_knopp(logits: torch.Tensor, temperature: float, iterations: int = 3, *,
                   distributed: bool = True,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Teacher targets by Sinkhorn-Knopp, DINOv2's `sinkhorn_knopp_teacher` (from SwAV).

    `Q = exp(logits / temperature)^T` (`[K, B]`) is scaled to total 1, then each iteration
    gives every prototype a total mass of 1/K (rows) and every sample 1/B (columns); the result
    is scaled by B so each target row sums to 1. With several ranks the sums run over the
    global batch, B included, so uneven row counts per rank (masked tokens) are exact.

    The largest score is subtracted before `exp` (a global constant, which the first
    normalisation cancels): DINOv2 does not, and overflows for scores above about 88 in
    float32. Half-precision logits are computed in float32, as DINOv2.

    Args:
        logits: the teacher's logits `[B, K]` (rows may be 0 on a rank).
        temperature: the teacher temperature (DINOv2: 0.04 warming up to 0.07).
        iterations: Sinkhorn iterations (3, as DINOv2).
        distributed: all-reduce the sums when `torch.distributed` is initialised with more
            than one rank; False normalises over this rank's rows only.
        group: the process group of the all-reduce (the default group when None).

    Returns:
        Targets `[B, K]`, each row a distribution over the prototypes.

    Raises:
        ValueError: if logits are not `[B, K]` or the temperature is not positive.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, K], got {list(logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    reduce = _world(distributed, group)
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    peak = scores.amax() if scores.numel() else scores.new_tensor(float("-inf"))
    peak = _all_reduce(peak, reduce, group, maximum=True)
    q = torch.exp(scores - peak).T  # (K, B)
    prototypes = q.shape[0]
    samples = _all_reduce(q.new_tensor(float(q.shape[1])), reduce, group)  # B over all ranks
    q = q / _all_reduce(q.sum(), reduce, group)
    for _ in range(iterations):
        q = q / _all_reduce(q.sum(dim=1, keepdim=True), reduce, group) / prototypes
        q = q / q.sum(dim=0, keepdim=True) / samples  # a column lies on one rank: no reduce
    return (q * samples).T


@torch.no_grad()
def softmax_center(logits: torch.Tensor, center: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """DINO's teacher targets: `softmax((logits - center) / temperature)` over prototypes.

    Args:
        logits: the teacher's logits `[..., K]`.
        center: `[1, K]`, usually `Center.center` (float32, so the result is at least float32).
        temperature: the teacher temperature.

    Returns:
        Targets shaped as `logits`, each row summing to 1; never part of the autograd graph.
    """
    return torch.softmax((logits - center) / temperature, dim=-1)


class Center(nn.Module):
    """DINO's running center of the teacher's logits, subtracted before its softmax.

    `update` moves the `center` buffer `[1, K]` toward the batch mean:
    `center = momentum * center + (1 - momentum) * mean`. With several ranks the mean is the
    global one, the sum and the row count each all-reduced, so ranks with different numbers of
    rows (masked tokens) weigh each row equally; lightly and DINOv2's iBOT center average the
    per-rank means instead, the same when every rank has as many rows. DINOv2 overlaps that
    all-reduce with the student's forward (`async_op`); this one is synchronous. A batch with
    no rows on any rank leaves the center as it was.

    Args:
        dim: K.
        momentum: the EMA momentum (0.9, as DINO and DINOv2).
        distributed: all-reduce the batch mean when `torch.distributed` is initialised with
            more than one rank.
        group: the process group of the all-reduce (the default group when None).
    """

    center: torch.Tensor

    def __init__(self, dim: int, momentum: float = 0.9, *, distributed: bool = True,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must lie in [0, 1], got {momentum}")
        self.momentum, self.distributed, self.group = momentum, distributed, group
        self.register_buffer("center", torch.zeros(1, dim))

    @torch.no_grad()
    def update(self, logits: torch.Tensor) -> None:
        """Moves the center toward the mean of `logits` `[..., K]` (every row counts once)."""
        rows = logits.detach().reshape(-1, self.center.shape[-1]).to(self.center.dtype)
        totals = torch.cat([rows.sum(dim=0), rows.new_tensor([rows.shape[0]])])  # (K + 1,)
        totals = _all_reduce(totals, _world(self.distributed, self.group), self.group)
        mean = totals[:-1] / totals[-1].clamp(min=1)
        moved = self.center * self.momentum + mean * (1 - self.momentum)
        self.center.copy_(torch.where(totals[-1] > 0, moved, self.center))


def dino_loss(student_logits: list[torch.Tensor], teacher_probs: list[torch.Tensor],
              student_temp: float = 0.1) -> torch.Tensor:
    """DINO's cross-entropy between the teacher's targets and the student's views.

    Every (teacher view t, student view s) pair with t != s contributes the batch mean of
    `-sum_k p_t log softmax(z_s / student_temp)`; the loss is the mean over those pairs. The
    student's views start with the views the teacher saw, in the same order (the global
    crops), then the others (local crops), so view i is never matched with itself. This is
    lightly's `DINOLoss` and DINOv2's global plus local terms divided by their count (DINOv2
    counts one local term when there are no local crops, dividing by 3 instead of 2 then).

    Args:
        student_logits: one `[B, K]` per student view.
        teacher_probs: one `[B, K]` target per teacher view (`softmax_center` or
            `sinkhorn_knopp`).
        student_temp: the student temperature (0.1).

    Returns:
        The scalar loss.

    Raises:
        ValueError: if the views differ in shape or no pair of different views exists.
    """
    shapes = {tuple(view.shape) for view in (*student_logits, *teacher_probs)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"every view must be the same [B, K], got shapes {sorted(shapes)}")
    teachers, students = len(teacher_probs), len(student_logits)
    same = min(teachers, students)  # views 0 .. same - 1 are seen by both
    pairs = teachers * students - same
    if pairs == 0:
        raise ValueError(f"{teachers} teacher and {students} student views leave no pair of "
                         "different views")
    log_probs = [F.log_softmax(view / student_temp, dim=-1) for view in student_logits]
    # sum over t != s of <p_t, log q_s> = <sum_t p_t, sum_s log q_s> - sum_v <p_v, log q_v>
    every_pair = (sum(teacher_probs) * sum(log_probs)).sum()
    same_view = sum((p * log_q).sum()
                    for p, log_q in zip(teacher_probs[:same], log_probs[:same], strict=True))
    return -(every_pair - same_view) / (pairs * student_logits[0].shape[0])


def ibot_patch_loss(student_logits: torch.Tensor, teacher_probs: torch.Tensor,
                    image_index: torch.Tensor, num_images: int,
                    student_temp: float = 0.1) -> torch.Tensor:
    """iBOT's masked-token cross-entropy, as DINOv2's `forward_masked`.

    Each masked token's cross-entropy `-sum_k p log softmax(z / student_temp)` is averaged
    within its image, and the per-image averages over all `num_images` images (an image with
    no masked token adds 0), so every masked image weighs the same however many tokens it
    masks. Tokens name their image by index rather than by position in a `[B, H, W]` mask, so
    images of different grids (native resolution, packed sequences) need no common shape.

    Args:
        student_logits: the student's logits `[M, K]` at the masked tokens.
        teacher_probs: the teacher's targets `[M, K]` at the same tokens.
        image_index: `[M]` integers in `[0, num_images)`, the image of each token.
        num_images: B, the images the masks were drawn for, masked or not.
        student_temp: the student temperature (0.1).

    Returns:
        The scalar loss; 0 (still differentiable) when no token is masked.

    Raises:
        ValueError: if the shapes disagree or `num_images` is not positive.
    """
    if student_logits.ndim != 2 or student_logits.shape != teacher_probs.shape:
        raise ValueError(f"student and teacher must both be [M, K], got "
                         f"{list(student_logits.shape)} and {list(teacher_probs.shape)}")
    if image_index.shape != student_logits.shape[:1]:
        raise ValueError(f"image_index must be [{student_logits.shape[0]}], got "
                         f"{list(image_index.shape)}")
    if num_images < 1:
        raise ValueError(f"num_images must be positive, got {num_images}")
    token_loss = -(teacher_probs * F.log_softmax(student_logits / student_temp, dim=-1)).sum(-1)
    # index_add_ rejects an index outside [0, num_images) without a host-device sync
    per_image = token_loss.new_zeros(num_images).index_add(0, image_index, token_loss)
    tokens = token_loss.new_zeros(num_images).index_add_(0, image_index,
                                                         torch.ones_like(token_loss))
    return (per_image / tokens.clamp(min=1)).sum() / num_images


def koleo_loss(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The KoLeo regulariser (Kozachenko-Leonenko entropy estimator) as DINOv2 applies it.

    Rows are L2-normalised; each row's nearest neighbour is the other row of largest cosine
    similarity, and the loss is the mean of `-log(||x_i - x_nn(i)|| + eps)`, pushing the
    batch's features apart. Computed in at least float32 with autocast off, as DINOv2. DINOv2
    applies it to each global crop's class tokens separately and sums.

    Args:
        x: features `[B, D]`, B >= 2.
        eps: guards the normalisation, the distance (added to the difference, as
            `torch.pairwise_distance`) and the logarithm.

    Returns:
        The scalar loss.

    Raises:
        ValueError: if x is not `[B, D]` with at least two rows.
    """
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"KoLeo needs [B, D] with B >= 2, got {list(x.shape)}")
    with torch.autocast(device_type=x.device.type, enabled=False):
        x = F.normalize(x.to(torch.promote_types(x.dtype, torch.float32)), dim=-1, eps=eps)
        with torch.no_grad():
            similarity = x @ x.T  # (B, B)
            similarity.fill_diagonal_(float("-inf"))  # a row is never its own neighbour
            neighbour = similarity.argmax(dim=1)
        distance = F.pairwise_distance(x, x[neighbour], p=2, eps=eps)
        return -torch.log(distance + eps).mean()
