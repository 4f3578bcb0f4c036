import torch

from vlm_vit.analysis import patch_position_embeddings, position_similarity
from vlm_vit.layers.pos_embed import sincos_2d_pos_embed


def test_sincos_neighbours_are_more_alike_than_far_patches():
    rows = cols = 8
    similarity = position_similarity(sincos_2d_pos_embed((rows, cols), 64))  # (64, 64)
    assert similarity.shape == (64, 64)
    assert torch.allclose(similarity.diagonal(), torch.ones(64), atol=1e-5)
    y, x = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    cells = torch.stack([y.reshape(-1), x.reshape(-1)], 1).float()
    steps = torch.cdist(cells, cells)  # grid distance between patches
    near = similarity[steps == 1]
    far = similarity[steps >= 5]
    assert near.mean() > far.mean() + 0.1  # about 0.98 against 0.79
    # And patch by patch: a patch's nearest neighbours beat every patch 5+ steps away.
    centre = 3 * cols + 3
    assert similarity[centre][steps[centre] == 1].min() > similarity[centre][
        steps[centre] >= 5].max()


def test_patch_position_embeddings_skip_the_class_entry():
    table = torch.arange(30, dtype=torch.float32).reshape(1, 5, 6)
    assert torch.equal(patch_position_embeddings(table, (2, 2), class_token=True), table[0, 1:])
    assert torch.equal(patch_position_embeddings(table[:, 1:], (2, 2), class_token=False),
                       table[0, 1:])
