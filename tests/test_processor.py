"""Tests for vlm_vit.processor.ImageProcessor."""

from __future__ import annotations

import dataclasses
import json
import warnings

import hypothesis
import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from PIL import Image, ImageFile

from tests.hostile_images import HOSTILE, huge_png
from vlm_vit.processor import (
    NORMALIZATION,
    PROCESSOR_CONFIG_NAME,
    ImageLoadError,
    ImageProcessor,
    ImageTooLargeError,
    native_size,
)

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def expected_pixel(proc: ImageProcessor, rgb) -> torch.Tensor:
    """The normalised value of a constant colour, ``[3]``."""
    x = torch.tensor(rgb, dtype=torch.float32) / 255.0
    return (x - torch.tensor(proc.mean)) / torch.tensor(proc.std)


def assert_colour(proc: ImageProcessor, out: torch.Tensor, rgb, levels: float = 1.0) -> None:
    """Every pixel of ``out`` ``[3, H, W]`` is ``rgb`` within ``levels`` of 0..255."""
    diff = (out - expected_pixel(proc, rgb)[:, None, None]).abs().amax(dim=(1, 2))
    tol = levels / 255.0 / torch.tensor(proc.std) + 1e-6
    assert bool((diff <= tol).all()), f"max diff per channel {diff.tolist()} for {rgb}"


def noise_image(height: int, width: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# ---- input types and shapes ---------------------------------------------------------


def _inputs(tmp_path):
    rgb = np.random.default_rng(1).integers(0, 256, (40, 30, 3), dtype=np.uint8)
    noise_image(40, 30).save(tmp_path / "a.png")
    return {
        "pil": Image.fromarray(rgb),
        "numpy_uint8": rgb,
        "numpy_float": rgb / 255.0,
        "numpy_gray": rgb[..., 0],
        "tensor_uint8": torch.from_numpy(rgb).permute(2, 0, 1),
        "tensor_float": torch.from_numpy(rgb).permute(2, 0, 1) / 255.0,
        "tensor_gray": torch.from_numpy(rgb[None, :, :, 1] / 255.0),
        "path_str": str(tmp_path / "a.png"),
        "path": tmp_path / "a.png",
    }


@pytest.mark.parametrize("kind", ["pil", "numpy_uint8", "numpy_float", "numpy_gray",
                                  "tensor_uint8", "tensor_float", "tensor_gray", "path_str",
                                  "path"])
def test_single_input_shape_and_dtype(tmp_path, kind):
    proc = ImageProcessor(size=(16, 24))
    out = proc(_inputs(tmp_path)[kind])
    assert out.shape == (1, 3, 16, 24)
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert torch.equal(proc.preprocess_one(_inputs(tmp_path)[kind]), out[0])


def test_list_mixing_types_and_4d_batch(tmp_path):
    proc = ImageProcessor(size=16)
    inp = _inputs(tmp_path)
    batch = torch.rand(2, 3, 20, 20)
    items = [inp["pil"], batch, inp["numpy_float"], inp["path"]]
    out = proc(items)
    assert out.shape == (5, 3, 16, 16) and out.dtype == torch.float32
    # Each row equals the image processed on its own: order is kept, the batch expands.
    singles = [proc(inp["pil"]), proc(batch), proc(inp["numpy_float"]), proc(inp["path"])]
    assert torch.equal(out, torch.cat(singles))
    assert proc(batch).shape == (2, 3, 16, 16)


def test_uint8_inputs_agree_across_types():
    rgb = np.random.default_rng(2).integers(0, 256, (33, 47, 3), dtype=np.uint8)
    proc = ImageProcessor(size=(20, 28))
    ref = proc(Image.fromarray(rgb))
    assert torch.equal(proc(rgb), ref)
    assert torch.equal(proc(torch.from_numpy(rgb).permute(2, 0, 1)), ref)


# ---- normalisation and resizing -----------------------------------------------------


@pytest.mark.parametrize("family", sorted(NORMALIZATION))
def test_normalisation_of_constant_colour_is_exact(family):
    rgb = (10, 128, 250)
    proc = ImageProcessor.for_family(family, size=12)
    out = proc(Image.new("RGB", (30, 20), rgb))[0]
    mean, std = NORMALIZATION[family]
    want = [(v / 255.0 - m) / s for v, m, s in zip(rgb, mean, std, strict=True)]
    for c in range(3):
        assert torch.allclose(out[c], torch.full((12, 12), want[c]), atol=1e-6, rtol=0)
    # Float input takes the torch resize path; a constant stays constant there too.
    out_f = proc(np.full((20, 30, 3), rgb, dtype=np.float32) / 255.0)[0]
    assert torch.allclose(out_f, out, atol=1e-5, rtol=0)


def _three_bands():
    """100x200 image: red columns 0..40, green 40..160, blue 160..200."""
    arr = np.zeros((100, 200, 3), dtype=np.uint8)
    arr[:, :40], arr[:, 40:160], arr[:, 160:] = RED, GREEN, BLUE
    return arr


@pytest.mark.parametrize("as_float", [False, True])
def test_shortest_edge_keeps_aspect_and_crops_centre(as_float):
    arr = _three_bands()
    proc = ImageProcessor(size=20, resize_mode="shortest_edge")
    # 100x200 -> 20x40, crop columns 10..30 = source columns 50..150: green only.
    out = proc(arr / 255.0 if as_float else arr)[0]
    assert_colour(proc, out, GREEN, levels=1.0)


@pytest.mark.parametrize("as_float", [False, True])
def test_squash_keeps_whole_image(as_float):
    arr = _three_bands()
    proc = ImageProcessor(size=20, resize_mode="squash")
    out = proc(arr / 255.0 if as_float else arr)[0]
    assert_colour(proc, out[:, :, :2], RED, levels=2.0)
    assert_colour(proc, out[:, :, 8:12], GREEN, levels=2.0)
    assert_colour(proc, out[:, :, -2:], BLUE, levels=2.0)


def test_shortest_edge_with_non_square_target_covers_it():
    proc = ImageProcessor(size=(16, 32))
    arr = np.zeros((64, 64, 3), dtype=np.uint8)
    arr[:16], arr[16:48], arr[48:] = RED, GREEN, BLUE
    # 64x64 -> 32x32 (cover 16x32), crop rows 8..24 = source rows 16..48: green.
    out = proc(arr)[0]
    assert out.shape == (3, 16, 32)
    assert_colour(proc, out[:, 2:-2], GREEN, levels=1.0)


def test_parity_with_open_clip_and_torchvision_on_a_real_photo():
    """CLIP's eval preprocessing, as open_clip itself builds it (`image_transform(224,
    is_train=False)`: Resize(224, bicubic) on the PIL image, CenterCrop, ToTensor,
    Normalize), and torchvision's Resize + CenterCrop: equal to ours (measured 0.0)."""
    data = pytest.importorskip("skimage.data")
    open_clip = pytest.importorskip("open_clip")
    transforms = pytest.importorskip("torchvision.transforms")
    rgb = data.astronaut()[:, :399]  # 512x399: resized to 287x224, crop top = round(31.5)
    proc = ImageProcessor.for_family("clip", size=224, resample="bicubic")
    out = proc(rgb)[0]

    reference = open_clip.image_transform(224, is_train=False)
    torch.testing.assert_close(out, reference(Image.fromarray(rgb)), atol=1e-6, rtol=0)
    mean, std = NORMALIZATION["clip"]
    by_hand = transforms.Compose([
        transforms.Resize(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize(list(mean), list(std))])
    torch.testing.assert_close(out, by_hand(Image.fromarray(rgb)), atol=1e-6, rtol=0)


# ---- centre-crop rounding ----------------------------------------------------------


def normalise(proc: ImageProcessor, x: torch.Tensor) -> torch.Tensor:
    """``[3, H, W]`` in [0, 1] normalised with ``proc``'s mean and std."""
    return (x - torch.tensor(proc.mean)[:, None, None]) / torch.tensor(proc.std)[:, None, None]


# An image already at the size that covers the 32 x 32 crop is not resized, so the output is
# exactly the crop: a 15-pixel overhang starts it at round(7.5) = 8 or floor 7; a 13-pixel one
# at round(6.5) = 6 = floor; an even one halves exactly.
@pytest.mark.parametrize("long_side, offsets", [(47, {"round": 8, "floor": 7}),
                                                (45, {"round": 6, "floor": 6}),
                                                (46, {"round": 7, "floor": 7})])
@pytest.mark.parametrize("portrait", [False, True], ids=["landscape", "portrait"])
@pytest.mark.parametrize("kind", ["pil", "tensor"])
def test_crop_offset_rounding(long_side, offsets, portrait, kind):
    height, width = (long_side, 32) if portrait else (32, long_side)
    rgb = np.asarray(noise_image(height, width, seed=long_side))
    image = Image.fromarray(rgb) if kind == "pil" else torch.from_numpy(rgb / 255.0).permute(
        2, 0, 1)
    source = torch.from_numpy(rgb / 255.0).permute(2, 0, 1).float()
    for rounding, offset in offsets.items():
        proc = ImageProcessor(size=32, crop_rounding=rounding)
        crop = source[:, offset:offset + 32] if portrait else source[:, :, offset:offset + 32]
        torch.testing.assert_close(proc(image)[0], normalise(proc, crop), atol=1e-6, rtol=0)


def photos_427x640() -> list[Image.Image]:
    """``skimage.data.rocket()`` (640 x 427) and ``coffee()`` resized to 640 x 427, landscape
    and portrait: at 336 the long side becomes 503, the overhang 167, the offset 83.5."""
    data = pytest.importorskip("skimage.data")
    rocket = Image.fromarray(data.rocket())
    coffee = Image.fromarray(data.coffee()).resize((640, 427), Image.Resampling.BICUBIC)
    return [image for photo in (rocket, coffee)
            for image in (photo, photo.transpose(Image.Transpose.TRANSPOSE))]


# (size, whether round and floor disagree): 336 overhangs 167 (83.5 -> 84 or 83); 300
# overhangs 149 (74.5 -> 74 either way).
ROUNDING_SIZES = [(336, True), (300, False)]


@pytest.mark.parametrize("size, differ", ROUNDING_SIZES)
def test_floor_matches_transformers_on_photos(size, differ):
    transformers = pytest.importorskip("transformers")
    settings = dict(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    floor = ImageProcessor.for_family("clip", size=size, crop_rounding="floor")
    rounded = ImageProcessor.for_family("clip", size=size, crop_rounding="round")
    for photo in photos_427x640():
        ours = floor(photo)
        theirs = transformers.CLIPImageProcessorPil(**settings)(
            images=photo, return_tensors="pt").pixel_values
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
        assert (rounded(photo) - ours).abs().max().item() > 0.1 if differ else \
            torch.equal(rounded(photo), ours)
        # The default (torchvision) backend resizes with other arithmetic than PIL; given the
        # image at the size it resizes to, it only crops, and crops as the PIL backend does.
        short, long = sorted(photo.size)
        scaled = (size, int(size * long / short))  # (width, height) of a portrait photo
        resized = photo.resize(scaled if photo.width < photo.height else scaled[::-1],
                               Image.Resampling.BICUBIC)
        fast = transformers.CLIPImageProcessor(**settings, do_resize=False)(
            images=resized, return_tensors="pt").pixel_values
        torch.testing.assert_close(floor(resized), fast, atol=1e-5, rtol=0)


@pytest.mark.parametrize("size, differ", ROUNDING_SIZES)
def test_round_matches_torchvision_on_photos(size, differ):
    transforms = pytest.importorskip("torchvision.transforms")
    bicubic = transforms.InterpolationMode.BICUBIC
    proc = ImageProcessor.for_family("clip", size=size, crop_rounding="round")
    pil_reference = transforms.Compose([  # OpenAI CLIP's and open_clip's eval transform
        transforms.Resize(size, interpolation=bicubic), transforms.CenterCrop(size),
        transforms.ToTensor(), transforms.Normalize(proc.mean, proc.std)])
    tensor_reference = transforms.Compose([
        transforms.Resize(size, interpolation=bicubic, antialias=True),
        transforms.CenterCrop(size)])
    for photo in photos_427x640():
        torch.testing.assert_close(proc(photo)[0], pil_reference(photo), atol=1e-5, rtol=0)
        pixels = torch.from_numpy(np.array(photo)).permute(2, 0, 1) / 255.0
        # float tensors take the interpolate path, which clamps bicubic's overshoot to [0, 1]
        expected = normalise(proc, tensor_reference(pixels).clamp(0, 1))
        torch.testing.assert_close(proc(pixels)[0], expected, atol=1e-5, rtol=0)


# ---- PIL modes and EXIF ----------------------------------------------------------------


def _palette(index: int, transparent: bool) -> Image.Image:
    img = Image.new("P", (20, 10), index)
    img.putpalette([10, 20, 30, 200, 100, 50] + [0] * (256 * 3 - 6))
    if transparent:
        img.info["transparency"] = 0  # palette entry 0 is fully transparent
    return img


@pytest.mark.parametrize("make, rgb", [
    (lambda: Image.new("L", (20, 10), 77), (77, 77, 77)),
    (lambda: Image.new("1", (20, 10), 1), (255, 255, 255)),
    (lambda: Image.new("I;16", (20, 10), 257 * 100), (100, 100, 100)),
    (lambda: Image.new("I", (20, 10), 257 * 60), (60, 60, 60)),
    (lambda: Image.new("I", (20, 10), 60), (60, 60, 60)),
    (lambda: Image.new("F", (20, 10), 0.25), (64, 64, 64)),
    (lambda: Image.new("RGBA", (20, 10), (200, 100, 50, 255)), (200, 100, 50)),
    (lambda: Image.new("RGBA", (20, 10), (0, 0, 0, 0)), (255, 255, 255)),
    (lambda: Image.new("RGBA", (20, 10), (0, 0, 0, 51)), (204, 204, 204)),
    (lambda: Image.new("LA", (20, 10), (90, 255)), (90, 90, 90)),
    (lambda: Image.new("LA", (20, 10), (90, 0)), (255, 255, 255)),
    (lambda: _palette(0, transparent=True), (255, 255, 255)),
    (lambda: _palette(1, transparent=True), (200, 100, 50)),
    (lambda: _palette(0, transparent=False), (10, 20, 30)),
    (lambda: Image.new("CMYK", (20, 10), (0, 255, 128, 51)), (204, 0, 102)),
    (lambda: Image.new("YCbCr", (20, 10), (128, 128, 128)), (128, 128, 128)),
], ids=["L", "1", "I;16", "I-16bit", "I-8bit", "F", "RGBA-opaque", "RGBA-clear",
        "RGBA-partial", "LA-opaque", "LA-clear", "P-clear", "P-opaque", "P-no-alpha", "CMYK",
        "YCbCr"])
def test_pil_modes_become_rgb(make, rgb):
    proc = ImageProcessor(size=8, resize_mode="squash")
    assert_colour(proc, proc(make())[0], rgb, levels=1.0)


def test_transparency_uses_background_for_pil_and_numpy():
    proc = ImageProcessor(size=8, background=(0, 128, 0))
    clear = np.zeros((10, 10, 4), dtype=np.uint8)
    assert_colour(proc, proc(Image.fromarray(clear, mode="RGBA"))[0], (0, 128, 0))
    assert_colour(proc, proc(clear)[0], (0, 128, 0))
    assert_colour(proc, proc(clear.astype(np.float32))[0], (0, 128, 0))


def test_palette_png_with_transparency_from_file(tmp_path):
    path = tmp_path / "p.png"
    _palette(0, transparent=False).save(path, transparency=0)
    with Image.open(path) as img:
        assert img.mode == "P" and "transparency" in img.info
    proc = ImageProcessor(size=8)
    assert_colour(proc, proc(path)[0], (255, 255, 255))


def test_exif_orientation_is_applied(tmp_path):
    arr = np.zeros((24, 48, 3), dtype=np.uint8)  # wide, with a red top-left quadrant
    arr[:12, :24] = RED
    path = tmp_path / "rot.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    Image.fromarray(arr).save(path, exif=exif, quality=95)

    with Image.open(path) as img:
        stored = np.asarray(img.convert("RGB"))
    upright = np.ascontiguousarray(np.rot90(stored, k=-1))  # clockwise: now tall, 48x24
    proc = ImageProcessor(size=(32, 16), resize_mode="squash")
    out = proc(path)
    assert torch.allclose(out, proc(upright), atol=1e-6)
    assert not torch.allclose(out, proc(stored), atol=0.1)
    # Red quadrant ends at the top right once rotated clockwise.
    assert_colour(proc, out[0, :, 2:12, 10:], RED, levels=12.0)


# ---- file errors ---------------------------------------------------------------------


def _truncated(path, fmt):
    noise_image(64, 64).save(path, format=fmt)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize("make", [
    lambda d: (d / "corrupt.png").write_bytes(np.random.default_rng(0).bytes(500))
    and d / "corrupt.png",
    lambda d: _truncated(d / "half.png", "PNG"),
    lambda d: _truncated(d / "half.jpg", "JPEG"),
    lambda d: d / "missing.png",
    lambda d: (d / "notes.txt").write_text("not an image\n") and d / "notes.txt",
    lambda d: d,
], ids=["corrupt", "truncated-png", "truncated-jpeg", "missing", "text", "directory"])
def test_bad_files_raise_image_load_error(tmp_path, make):
    path = make(tmp_path)
    with pytest.raises(ImageLoadError) as info:
        ImageProcessor(size=8)(path)
    assert str(path) in str(info.value)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_truncated_message_says_truncated(tmp_path):
    path = _truncated(tmp_path / "half.jpg", "JPEG")
    with pytest.raises(ImageLoadError, match="truncated"):
        ImageProcessor(size=8)(path)


def test_too_many_pixels_checked_before_decoding(tmp_path):
    path = tmp_path / "big.png"
    noise_image(100, 100).save(path)
    proc = ImageProcessor(size=8, max_pixels=1000)
    with pytest.raises(ImageTooLargeError) as info:
        proc(path)
    assert str(path) in str(info.value) and "100x100" in str(info.value)
    assert "1000" in str(info.value)

    # A valid header with the pixel data cut off: decoding would fail with ImageLoadError,
    # so getting ImageTooLargeError shows the size is checked first.
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ImageLoadError):
        ImageProcessor(size=8)(path)
    with pytest.raises(ImageTooLargeError):
        proc(path)


def test_too_many_pixels_for_arrays_tensors_and_pil():
    proc = ImageProcessor(size=8, max_pixels=1000)
    for image in [np.zeros((40, 30, 3), np.uint8), torch.zeros(2, 3, 40, 30),
                  Image.new("RGB", (30, 40))]:
        with pytest.raises(ImageTooLargeError, match="30x40"):
            proc(image)
    assert proc(np.zeros((25, 40, 3), np.uint8)).shape == (1, 3, 8, 8)  # exactly the limit


def test_pil_decompression_bomb_error_and_warning_are_converted(tmp_path, monkeypatch):
    path = tmp_path / "big.png"
    noise_image(100, 100).save(path)
    proc = ImageProcessor(size=8)  # its own limit is far away: PIL's check fires
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # error above 2x = 2000 pixels
    with pytest.raises(ImageTooLargeError, match="big.png"):
        proc(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 6000)  # warning only (6000 < 10000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(ImageTooLargeError, match="big.png"):
            proc(path)


# ---- bad arrays and tensors ------------------------------------------------------------


@pytest.mark.parametrize("image, error, text", [
    (np.zeros((2, 4, 4, 3), np.uint8), ValueError, r"\(2, 4, 4, 3\)"),
    (np.zeros((4, 4, 2), np.uint8), ValueError, r"\(4, 4, 2\)"),
    (np.zeros((3, 8, 8), np.uint8), ValueError, "channels last"),
    (np.zeros((0, 4, 3), np.uint8), ValueError, "empty"),
    (np.full((4, 4, 3), 2.5), ValueError, r"\[2.5, 2.5\]"),
    (np.full((4, 4, 3), -0.5), ValueError, r"\[-0.5, -0.5\]"),
    (np.full((4, 4, 3), np.nan), ValueError, "nan"),
    (np.zeros((4, 4, 3), bool), TypeError, "bool"),
    (np.zeros((4, 4, 3), np.int64), TypeError, "int64"),
    (torch.zeros(4, 8, 8), ValueError, r"\(4, 8, 8\)"),
    (torch.zeros(8, 8), ValueError, r"\(8, 8\)"),
    (torch.zeros(3, 0, 8), ValueError, "empty"),
    (torch.zeros(3, 8, 8, dtype=torch.complex64), TypeError, "complex64"),
    (torch.zeros(3, 8, 8, dtype=torch.bool), TypeError, "bool"),
    (torch.full((3, 8, 8), 1.5), ValueError, r"\[1.5, 1.5\]"),
    (42, TypeError, "int"),
    ([], ValueError, "empty"),
])
def test_bad_inputs_raise_clear_errors(image, error, text):
    with pytest.raises(error, match=text):
        ImageProcessor(size=8)(image)


# ---- settings ------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path):
    proc = ImageProcessor(size=(384, 256), resize_mode="squash", resample="bilinear",
                          mean=(0.1, 0.2, 0.3), std=(0.4, 0.5, 0.6), max_pixels=12345,
                          background=(1, 2, 3))
    directory = tmp_path / "nested" / "dir"
    assert proc.save_pretrained(directory) == directory  # as every save_pretrained returns
    assert sorted(p.name for p in directory.iterdir()) == [PROCESSOR_CONFIG_NAME]  # no temp
    assert json.loads((directory / PROCESSOR_CONFIG_NAME).read_text())["size"] == [384, 256]
    assert ImageProcessor.from_pretrained(directory) == proc
    assert ImageProcessor.from_dict(proc.to_dict()) == proc


def test_crop_rounding_is_saved_and_old_configs_round(tmp_path):
    proc = ImageProcessor(size=32, crop_rounding="floor")
    assert proc.to_dict()["crop_rounding"] == "floor"
    assert ImageProcessor.from_dict(proc.to_dict()) == proc
    proc.save_pretrained(tmp_path)
    assert ImageProcessor.from_pretrained(tmp_path) == proc
    # A config written before the field existed: torchvision's rounding, as then.
    old = {k: v for k, v in proc.to_dict().items() if k != "crop_rounding"}
    (tmp_path / PROCESSOR_CONFIG_NAME).write_text(json.dumps(old))
    assert ImageProcessor.from_pretrained(tmp_path).crop_rounding == "round"
    assert ImageProcessor.from_dict(old) == ImageProcessor(size=32)


def test_config_errors_name_key_and_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=PROCESSOR_CONFIG_NAME):
        ImageProcessor.from_pretrained(tmp_path)
    path = tmp_path / PROCESSOR_CONFIG_NAME
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON") as info:
        ImageProcessor.from_pretrained(tmp_path)
    assert str(path) in str(info.value)
    path.write_text(json.dumps({**ImageProcessor().to_dict(), "crop_pct": 0.9}))
    with pytest.raises(ValueError, match="crop_pct"):
        ImageProcessor.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="crop_pct"):
        ImageProcessor.from_dict({"crop_pct": 0.9})


@pytest.mark.parametrize("kwargs, text", [
    ({"size": 0}, "size"),
    ({"size": (224,)}, "size"),
    ({"size": (224.0, 224)}, "size"),
    ({"resize_mode": "crop"}, "shortest_edge.*squash"),
    ({"resample": "nearest"}, "bicubic.*bilinear"),
    ({"std": (0.5, 0.0, 0.5)}, "nonzero"),
    ({"mean": (0.5, 0.5)}, "3 values"),
    ({"max_pixels": 0}, "max_pixels"),
    ({"background": (0, 0, 256)}, "background"),
    ({"crop_rounding": "ceil"}, r"crop_rounding 'ceil' is not one of \('round', 'floor'\)"),
])
def test_invalid_settings(kwargs, text):
    with pytest.raises(ValueError, match=text):
        ImageProcessor(**kwargs)


def test_int_size_means_square_and_defaults():
    proc = ImageProcessor(size=160)
    assert proc.size == (160, 160)
    assert (proc.mean, proc.std) == NORMALIZATION["imagenet"]
    assert ImageProcessor().size == (224, 224)


def test_for_family():
    proc = ImageProcessor.for_family("clip", size=336)
    assert (proc.mean, proc.std) == NORMALIZATION["clip"]
    assert proc.size == (336, 336)
    with pytest.raises(ValueError, match="clip.*imagenet.*inception"):
        ImageProcessor.for_family("dino")


# ---- native resolution ---------------------------------------------------------------


def native(**kwargs) -> ImageProcessor:
    return ImageProcessor(**{"resize_mode": "native", "patch_multiple": 14, **kwargs})


def test_native_size_worked_numbers():
    # The numbers in native_size's docstring.
    assert native_size(1080, 1920, multiple=14, max_pixels=1_003_520) == (742, 1330)
    assert native_size(1080, 1920, multiple=28, max_pixels=1_003_520) == (728, 1316)
    assert native_size(400, 600, multiple=16) == (400, 608)
    assert native_size(20, 30, multiple=14, min_pixels=3136) == (56, 70)
    # By hand: rounding alone (38.57 -> 39, 68.57 -> 69 multiples of 28) when in bounds;
    # 30.5 rounds half to even, to 30, as Python's round in smart_resize; a side under half
    # a multiple becomes one multiple.
    assert native_size(1080, 1920, multiple=28) == (39 * 28, 69 * 28)
    assert native_size(427, 640, multiple=14) == (30 * 14, 46 * 14)
    assert native_size(3, 100, multiple=16) == (16, 96)
    # At the bound exactly nothing is scaled: 32 x 32 = 1024.
    assert native_size(32, 32, multiple=16, min_pixels=1024, max_pixels=1024) == (32, 32)


def _in_one_multiple_of_one_scale(height, width, out_h, out_w, multiple) -> bool:
    """Some scale s puts both sides within one multiple: |out - s * side| <= multiple."""
    low = max((out_h - multiple) / height, (out_w - multiple) / width)
    high = min((out_h + multiple) / height, (out_w + multiple) / width)
    return low <= high + 1e-12


@hypothesis.settings(max_examples=500, deadline=None)
@hypothesis.given(height=st.integers(1, 5000), width=st.integers(1, 5000),
       multiple=st.sampled_from([8, 14, 16, 28, 32]),
       min_pixels=st.one_of(st.none(), st.integers(1, 200_000)),
       extra=st.one_of(st.none(), st.integers(0, 2_000_000)))
def test_native_size_properties(height, width, multiple, min_pixels, extra):
    max_pixels = None if extra is None else (min_pixels or 1) + extra
    try:
        out_h, out_w = native_size(height, width, multiple=multiple, min_pixels=min_pixels,
                                   max_pixels=max_pixels)
    except ValueError as e:  # only a too-thin image, refused with its size
        assert f"height {height} and width {width}" in str(e)
        assert "aspect ratio" in str(e) or "outside" in str(e)
        return
    assert out_h > 0 and out_w > 0 and out_h % multiple == 0 and out_w % multiple == 0
    assert max_pixels is None or out_h * out_w <= max_pixels
    assert min_pixels is None or out_h * out_w >= min_pixels
    assert _in_one_multiple_of_one_scale(height, width, out_h, out_w, multiple)


def test_native_size_over_a_grid_of_photo_shapes_never_refuses():
    # Aspect ratios up to 4 with Qwen2-VL's bounds: every image fits.
    sides = list(range(20, 4001, 37))
    for height in sides:
        for width in sides:
            if max(height, width) > 4 * min(height, width):
                continue
            out_h, out_w = native_size(height, width, multiple=28, min_pixels=3136,
                                       max_pixels=1_003_520)
            assert out_h % 28 == 0 and out_w % 28 == 0
            assert 3136 <= out_h * out_w <= 1_003_520, (height, width)
            assert _in_one_multiple_of_one_scale(height, width, out_h, out_w, 28)
            # Without bounds each side is only rounded: within half a multiple.
            rounded_h, rounded_w = native_size(height, width, multiple=28)
            assert abs(rounded_h - height) <= 14 and abs(rounded_w - width) <= 14


def test_native_size_refuses_extreme_aspect_and_thin_strips():
    with pytest.raises(ValueError, match="height 10 and width 2010 has aspect ratio 201, "
                                         "more than the maximum 200"):
        native_size(10, 2010, multiple=14)
    assert native_size(10, 2000, multiple=14) == (14, 2002)  # exactly 200: accepted
    with pytest.raises(ValueError, match="aspect ratio 3.25, more than the maximum 3"):
        native_size(1300, 400, multiple=14, max_aspect=3)
    # The short side cannot go below one multiple, so the strip stays over the budget.
    with pytest.raises(ValueError, match=r"height 28 and width 5600 would be resized to "
                                         r"28 x 784 = 21952 pixels \(multiples of 28\), "
                                         r"outside max_pixels 3136"):
        native_size(28, 5600, multiple=28, max_pixels=3136)
    for kwargs, text in [({"multiple": 0}, "multiple must be a positive int, got 0"),
                         ({"multiple": 14, "max_pixels": 0}, "max_pixels must be a positive "
                                                            "int or None, got 0"),
                         ({"multiple": 14, "min_pixels": 10, "max_pixels": 5},
                          "min_pixels 10 is more than max_pixels 5")]:
        with pytest.raises(ValueError, match=text):
            native_size(100, 100, **kwargs)
    with pytest.raises(ValueError, match="height must be a positive int, got 0"):
        native_size(0, 100, multiple=14)


def test_processor_refuses_extreme_aspect_naming_the_image(tmp_path):
    proc = native()
    strip = np.zeros((10, 2010, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"^images\[1\]: image of height 10 and width 2010 "
                                         r"has aspect ratio 201"):
        proc([np.zeros((20, 20, 3), dtype=np.uint8), strip])
    Image.fromarray(strip).save(tmp_path / "strip.png")
    with pytest.raises(ValueError, match=r"^images\[0\] \(file '.*strip.png'\): image of "
                                         r"height 10 and width 2010"):
        proc([tmp_path / "strip.png"])
    with pytest.raises(ValueError, match=r"^image: .*height 28 and width 5600 would be "
                                         r"resized to 28 x 784"):
        native(patch_multiple=28, max_output_pixels=3136).preprocess_one(
            torch.rand(3, 28, 5600))


@pytest.mark.parametrize("kwargs, expected", [
    ({"patch_multiple": 16}, {"astronaut": (512, 512), "coffee": (400, 608),
                              "rocket": (432, 640)}),
    # 427 / 14 = 30.5 rounds half to even: 420.
    ({"patch_multiple": 14, "max_output_pixels": 1_003_520},
     {"astronaut": (518, 518), "coffee": (406, 602), "rocket": (420, 644)}),
    # A 256-patch budget at patch 16: beta = 2 for the astronaut; ~1.91 and ~2.04 for the
    # others, whose sides floor to 13 x 19 patches.
    ({"patch_multiple": 16, "max_output_pixels": 256 * 16 * 16},
     {"astronaut": (256, 256), "coffee": (208, 304), "rocket": (208, 304)}),
    ({"patch_multiple": 28, "min_output_pixels": 3136, "max_output_pixels": 1_003_520},
     {"astronaut": (504, 504), "coffee": (392, 588), "rocket": (420, 644)}),
])
def test_photos_get_their_native_sizes(kwargs, expected):
    data = pytest.importorskip("skimage.data")
    photos = {name: getattr(data, name)() for name in expected}
    assert {name: photo.shape for name, photo in photos.items()} == {
        "astronaut": (512, 512, 3), "coffee": (400, 600, 3), "rocket": (427, 640, 3)}
    proc = native(**kwargs)
    out = proc(list(photos.values()))
    assert isinstance(out, list) and len(out) == 3
    for (name, photo), pixels in zip(photos.items(), out, strict=True):
        assert pixels.shape == (3, *expected[name]), name
        assert pixels.dtype == torch.float32 and pixels.is_contiguous()
        # No crop: the same pixels as squashing the whole photo to that size.
        squash = dataclasses.replace(proc, resize_mode="squash", size=expected[name])
        assert torch.equal(pixels, squash(photo)[0]), name
        assert torch.equal(proc.preprocess_one(photo), pixels)


def test_native_returns_a_list_in_input_order():
    proc = native(patch_multiple=16)
    items = [noise_image(40, 30), torch.rand(2, 3, 20, 50), np.random.default_rng(0).random(
        (70, 33, 3)), noise_image(16, 16)]
    out = proc(items)
    assert isinstance(out, list)
    # 40 / 16 = 2.5 rounds half to even: 32; the batch of two expands in place.
    assert [tuple(t.shape) for t in out] == [(3, 32, 32), (3, 16, 48), (3, 16, 48),
                                             (3, 64, 32), (3, 16, 16)]
    assert all(t.dtype == torch.float32 for t in out)
    single = proc(noise_image(40, 30))  # one image: a list of one
    assert isinstance(single, list) and len(single) == 1 and torch.equal(single[0], out[0])
    assert torch.equal(proc.preprocess_one(items[2]), out[3])
    # Float inputs are resized with interpolate at the native size, as in squash mode.
    squash = dataclasses.replace(proc, resize_mode="squash", size=(64, 32))
    assert torch.equal(out[3], squash(items[2])[0])
    # Other modes still stack.
    assert ImageProcessor(size=16)(items).shape == (5, 3, 16, 16)


def test_native_fields_round_trip(tmp_path):
    proc = ImageProcessor.for_family("clip", resize_mode="native", patch_multiple=28,
                                     min_output_pixels=3136, max_output_pixels=1_003_520,
                                     max_aspect_ratio=50)
    assert proc.max_aspect_ratio == 50.0 and isinstance(proc.max_aspect_ratio, float)
    saved = proc.to_dict()
    assert {k: saved[k] for k in ("resize_mode", "patch_multiple", "min_output_pixels",
                                     "max_output_pixels", "max_aspect_ratio")} == {
        "resize_mode": "native", "patch_multiple": 28, "min_output_pixels": 3136,
        "max_output_pixels": 1_003_520, "max_aspect_ratio": 50.0}
    assert ImageProcessor.from_dict(saved) == proc
    path = proc.save_pretrained(tmp_path) / PROCESSOR_CONFIG_NAME
    assert json.loads(path.read_text())["patch_multiple"] == 28
    assert ImageProcessor.from_pretrained(tmp_path) == proc


def test_configs_without_native_fields_load_unchanged(tmp_path):
    new = ("patch_multiple", "min_output_pixels", "max_output_pixels", "max_aspect_ratio")
    proc = ImageProcessor(size=(64, 48), resize_mode="squash", crop_rounding="floor")
    old = {k: v for k, v in proc.to_dict().items() if k not in new}
    (tmp_path / PROCESSOR_CONFIG_NAME).write_text(json.dumps(old))
    loaded = ImageProcessor.from_pretrained(tmp_path)
    assert loaded == proc == ImageProcessor.from_dict(old)
    assert (loaded.patch_multiple, loaded.min_output_pixels, loaded.max_output_pixels,
            loaded.max_aspect_ratio) == (None, None, None, 200.0)
    image = noise_image(40, 30)
    assert torch.equal(loaded(image), proc(image)) and loaded(image).shape == (1, 3, 64, 48)
    # The native fields are unused outside native mode.
    ignored = dataclasses.replace(proc, patch_multiple=14, max_output_pixels=1000)
    assert torch.equal(ignored(image), proc(image))


@pytest.mark.parametrize("kwargs, text", [
    ({"resize_mode": "native"}, "resize_mode 'native' needs patch_multiple"),
    ({"patch_multiple": 0}, "patch_multiple must be a positive int or None, got 0"),
    ({"patch_multiple": 14.0}, "patch_multiple must be a positive int or None, got 14.0"),
    ({"min_output_pixels": -1}, "min_output_pixels must be a positive int or None, got -1"),
    ({"max_output_pixels": True}, "max_output_pixels must be a positive int or None"),
    ({"min_output_pixels": 5000, "max_output_pixels": 4000},
     "min_output_pixels 5000 is more than max_output_pixels 4000"),
    ({"patch_multiple": 28, "max_output_pixels": 700},
     r"max_output_pixels 700 is less than one patch_multiple squared, 28\*\*2 = 784"),
    ({"max_aspect_ratio": 0.5}, "max_aspect_ratio must be a finite number >= 1, got 0.5"),
    ({"max_aspect_ratio": float("inf")}, "max_aspect_ratio must be a finite number >= 1"),
    ({"max_aspect_ratio": "200"}, "max_aspect_ratio must be a finite number >= 1, got '200'"),
])
def test_invalid_native_settings_name_the_field(kwargs, text):
    with pytest.raises(ValueError, match=text):
        ImageProcessor(**kwargs)


# ---- hostile files (issue 26, section 4) -------------------------------------------------


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_any_pil_failure_is_an_image_load_error_naming_the_file(tmp_path, kind):
    """PIL raises NotImplementedError (DDS) and TypeError (IM) on these, not OSError."""
    path = tmp_path / "photo.jpg"
    path.write_bytes(HOSTILE[kind]())
    proc = ImageProcessor(size=8)
    for call in (proc, proc.preprocess_one, lambda p: proc.load(p, "x")):
        with pytest.raises(ImageLoadError, match="photo.jpg") as info:
            call(path)
        assert ("NotImplementedError" if kind == "dds" else "TypeError") in str(info.value)
    with pytest.raises(ImageLoadError, match="shard-3.tar:key-7"):  # bytes, from a tar member
        proc.load(path.read_bytes(), "image shard-3.tar:key-7")


def test_a_lazy_pil_image_that_fails_to_load_is_an_image_load_error():
    import io

    image = Image.open(io.BytesIO(HOSTILE["im"]()))  # opens; loading it raises TypeError
    with pytest.raises(ImageLoadError, match="images\\[0\\]"):
        ImageProcessor(size=8)([image])


@pytest.mark.parametrize("resize_mode", ["shortest_edge", "native"])
def test_a_decompression_bomb_header_is_too_large_in_every_mode(tmp_path, resize_mode):
    path = tmp_path / "bomb.png"
    path.write_bytes(huge_png())  # 45 bytes, 60000 x 60000 by its header
    proc = ImageProcessor(size=8, resize_mode=resize_mode, patch_multiple=8)
    with pytest.raises(ImageTooLargeError, match="bomb.png"):
        proc(path)
    with pytest.raises(ImageTooLargeError, match="bomb.png"):
        proc.output_size(path)


def test_output_size_reads_the_header_and_names_the_file(tmp_path):
    path = tmp_path / "wide.png"
    noise_image(30, 70).save(path)
    native = ImageProcessor(resize_mode="native", patch_multiple=8, max_output_pixels=64 * 8)
    assert native.output_size(path) == tuple(native(path)[0].shape[1:]) == (8, 32)
    assert ImageProcessor(size=(16, 24)).output_size(path) == (16, 24)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate a quarter: the sides swap
    noise_image(30, 70).save(tmp_path / "turned.jpg", exif=exif)
    assert native.output_size(tmp_path / "turned.jpg") == (32, 8)
    noise_image(1, 300).save(tmp_path / "thin.png")
    for call in (native, native.output_size):  # aspect ratio 300 > 200
        with pytest.raises(ValueError, match="thin.png.*aspect ratio"):
            call(tmp_path / "thin.png")
    with pytest.raises(ImageLoadError, match="missing.png"):
        native.output_size(tmp_path / "missing.png")
