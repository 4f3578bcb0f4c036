import torch

from vlm_vit.analysis import embedding_filters


def test_the_top_component_is_recovered_up_to_sign():
    torch.manual_seed(0)
    width, channels, patch = 64, 3, 4
    features = channels * patch * patch
    basis, _ = torch.linalg.qr(torch.randn(features, 3, dtype=torch.float64))  # orthonormal
    strengths = torch.tensor([10.0, 3.0, 1.0], dtype=torch.float64)  # decreasing variance
    coefficients = torch.randn(width, 3, dtype=torch.float64) * strengths
    weights = coefficients @ basis.T + 0.01 * torch.randn(width, features, dtype=torch.float64)
    weights = (weights + 5.0).float().reshape(width, channels, patch, patch)  # PCA centres
    components, explained = embedding_filters(weights, count=28)
    assert components.shape == (28, channels, patch, patch)
    assert explained.shape == (28,) and (explained[:-1] >= explained[1:]).all()
    for index in range(3):
        cosine = components[index].reshape(-1).double() @ basis[:, index]
        assert abs(cosine.item()) > 0.99
    assert explained[0] > 0.8  # 100 / (100 + 9 + 1) of the variance, noise aside


def test_fewer_components_come_back_when_the_weights_have_fewer():
    components, explained = embedding_filters(torch.randn(5, 3, 2, 2), count=28)
    assert components.shape == (5, 3, 2, 2) and explained.shape == (5,)
    # Signs are fixed: each component's largest entry is positive.
    flat = components.reshape(5, -1)
    assert (flat.gather(1, flat.abs().argmax(1, keepdim=True)) > 0).all()
