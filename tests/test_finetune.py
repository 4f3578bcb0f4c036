import math

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_vit import EncoderConfig, VisionEncoder, VisionTower, build_pooler
from vlm_vit.adapt.finetune import ImageClassifier
from vlm_vit.packing import PackedImages

SIZES = dict(image_size=32, patch_size=8, width=32, depth=2, heads=4, mlp_width=64)


def encoder(**overrides):
    torch.manual_seed(0)
    return VisionEncoder(EncoderConfig(**{**SIZES, **overrides}))


def test_zero_initialised_head_starts_at_chance():
    classifier = ImageClassifier(encoder(), num_classes=5)
    out = classifier(torch.randn(3, 3, 32, 32), labels=torch.tensor([0, 1, 4]))
    assert out.loss.item() == pytest.approx(math.log(5))
    assert torch.equal(classifier(torch.randn(2, 3, 32, 32)), torch.zeros(2, 5))


def test_pooling_choices():
    model = encoder()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        torch.testing.assert_close(ImageClassifier(model, 3).features(x), out.cls_token)
        torch.testing.assert_close(ImageClassifier(model, 3, pooling="mean").features(x),
                                   out.patch_tokens.mean(1))
    with pytest.raises(ValueError, match="needs a class token"):
        ImageClassifier(encoder(class_token=False), 3)


PACKED_SIZES = [(32, 32), (24, 40), (48, 16), (8, 32)]


def packed_classifiers(backbone: str, pooling: str):
    """Two identical classifiers (head randomised, so gradients reach the encoder)."""
    made = []
    for _ in range(2):
        if backbone == "tower":
            torch.manual_seed(1)
            model = VisionTower(encoder(), build_pooler("attention_pool", in_dim=32, out_dim=16))
        else:
            model = encoder()
        classifier = ImageClassifier(model, 3, pooling=pooling)
        torch.manual_seed(2)
        classifier.head.weight.data.normal_(std=0.1)
        made.append(classifier)
    return made


@pytest.mark.parametrize("backbone, pooling", [("encoder", "cls"), ("encoder", "mean"),
                                               ("tower", "cls")])
def test_packed_batches_give_the_per_image_loss_and_gradients(backbone, pooling):
    generator = torch.Generator().manual_seed(3)
    images = PackedImages(torch.randn(3, h, w, generator=generator) for h, w in PACKED_SIZES)
    labels = torch.tensor([0, 2, 1, 2])
    packed, alone = packed_classifiers(backbone, pooling)
    out = packed(images, labels=labels)
    out.loss.backward()
    # The same mean loss, one image at a time.
    losses = [torch.nn.functional.cross_entropy(alone(image[None]), label[None])
              for image, label in zip(images, labels, strict=True)]
    expected = torch.stack(losses).mean()
    expected.backward()
    torch.testing.assert_close(out.loss, expected, atol=1e-6, rtol=1e-6)
    named = dict(alone.named_parameters())
    for name, parameter in packed.named_parameters():
        assert parameter.grad is not None, name
        torch.testing.assert_close(parameter.grad, named[name].grad, atol=1e-5, rtol=1e-5)


def test_packed_images_move_and_split_like_a_batch():
    images = PackedImages(torch.zeros(3, h, w) for h, w in PACKED_SIZES)
    assert len(images) == 4
    halves = images.tensor_split(3)
    assert [len(p) for p in halves] == [2, 1, 1]
    assert all(isinstance(p, PackedImages) for p in halves)
    assert halves[0][1] is images[1]
    assert images.to(torch.float64)[2].dtype == torch.float64


def test_a_frozen_encoder_keeps_no_graph_and_gets_no_gradient():
    classifier = ImageClassifier(encoder(), 3, freeze_encoder=True)
    x = torch.randn(2, 3, 32, 32)
    assert classifier.features(x).grad_fn is None
    classifier(x, labels=torch.tensor([0, 2])).loss.backward()
    assert all(p.grad is None for p in classifier.encoder.parameters())
    assert classifier.head.weight.grad is not None


def test_projector_only_training_of_a_tower():
    tower = VisionTower(encoder(), build_pooler("attention_pool", in_dim=32, out_dim=16))
    classifier = ImageClassifier(tower, 3, freeze_encoder=True)
    classifier.head.weight.data.normal_()  # so gradients reach the pooler through the head
    classifier(torch.randn(4, 3, 32, 32), labels=torch.tensor([0, 1, 2, 0])).loss.backward()
    assert all(p.grad is None for p in tower.encoder.parameters())
    assert all(p.grad is not None for p in tower.pooler.parameters())


@pytest.fixture
def digits_folder(tmp_path):
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits(n_class=3)
    pairs = zip(digits.images[:150], digits.target[:150], strict=True)
    for index, (image, label) in enumerate(pairs):
        folder = tmp_path / "digits" / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image / 16 * 255).astype(np.uint8)
        Image.fromarray(pixels).resize((32, 32), Image.Resampling.BICUBIC).save(
            folder / f"{index}.png")
    return tmp_path / "digits"


@pytest.mark.slow  # 100 steps; tests/cli/test_finetune.py checks the same through the CLI
def test_fine_tuning_on_real_digits_beats_chance_on_held_out_images(tmp_path, digits_folder):
    pytest.importorskip("torchvision")
    from vlm_vit.data.folders import LabelledImageFolder
    from vlm_vit.data.samples import collate_labelled
    from vlm_vit.eval import stratified_split
    from vlm_vit.train import TrainConfig, Trainer

    data = LabelledImageFolder(digits_folder, 32, mean=(0.5,) * 3, std=(0.5,) * 3)
    labels = np.array([label for _, label in data.samples])
    train, test = stratified_split(labels, 0.4, seed=0)
    classifier = ImageClassifier(encoder(), num_classes=3, pooling="mean")
    config = TrainConfig(steps=100, batch_size=16, lr=1e-2, warmup_steps=10, num_workers=0,
                         checkpoint_every=0, device="cpu")
    Trainer(classifier, torch.utils.data.Subset(data, train.tolist()), config, tmp_path / "run",
            collate=collate_labelled, progress=False).fit()
    images = torch.stack([data[i][0] for i in test])
    with torch.no_grad():
        predictions = classifier.eval()(images).argmax(-1).numpy()
    accuracy = (predictions == labels[test]).mean()
    assert accuracy > 0.6  # chance is 1/3


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_a_classifier_directory_loads_back_with_its_class_names(tmp_path, pooling):
    from vlm_vit import ImageProcessor, load_encoder

    classifier = ImageClassifier(encoder(), 3, pooling=pooling)
    torch.manual_seed(1)
    classifier.head.weight.data.normal_()
    processor = ImageProcessor.for_family("clip", size=32)
    classifier.save_pretrained(tmp_path / "clf", classes=["cat", "dog", "owl"],
                               processor=processor)
    back = ImageClassifier.from_pretrained(tmp_path / "clf")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(back(x), classifier.eval()(x))
    assert back.classes == ["cat", "dog", "owl"] and back.pooling == pooling
    assert load_encoder(tmp_path / "clf").config == classifier.encoder.config  # beside it
    assert ImageProcessor.from_pretrained(tmp_path / "clf") == processor
    with pytest.raises(ValueError, match="2 class names for 3 classes"):
        classifier.save_pretrained(tmp_path / "bad", classes=["a", "b"])


def test_a_tower_classifier_round_trips(tmp_path):
    tower = VisionTower(encoder(), build_pooler("attention_pool", in_dim=32, out_dim=16))
    classifier = ImageClassifier(tower, 4)
    torch.manual_seed(2)
    classifier.head.weight.data.normal_()
    classifier.save_pretrained(tmp_path / "clf")
    back = ImageClassifier.from_pretrained(tmp_path / "clf")
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(back(x), classifier.eval()(x))
    assert isinstance(back.backbone, VisionTower) and back.classes is None
