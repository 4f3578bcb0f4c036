"""A clip's frames sized and preprocessed as Qwen-VL's video processors do it (issue 44): our
`VideoProcessor` against transformers' `Qwen2VLVideoProcessor` and `Qwen3VLVideoProcessor`
on real frames that grow, shrink, hit the per-frame cap or are thin; the settings read as
transformers reads a folder; clips through `MultimodalLM` sized by the folder's own video
processor, with transformers' logits; written back and saved; what cannot be read or sized
is refused by name."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import photos
from PIL import Image

from vlm_vit import ImageProcessor
from vlm_vit_llm import MultimodalLM, Video, VideoProcessor
from vlm_vit_llm.hf_reading import video_processor_settings

transformers = pytest.importorskip("transformers")

CLASSES = {"qwen2_vl": ("Qwen2VLVideoProcessor", 14), "qwen3_vl": ("Qwen3VLVideoProcessor", 16)}
# (frames, height, width, transformers' settings): the class defaults (frames grow), small
# bounds (they shrink), an odd frame count (Qwen3-VL's bound counts 4 of 5 frames: 96 x 96,
# not 64 x 64), the per-frame cap (the bound that binds), a thin strip, bilinear resampling.
CASES = [(4, 90, 60, {}),
         (3, 300, 500, {"size": {"shortest_edge": 3136, "longest_edge": 28 * 28 * 64}}),
         (5, 100, 100, {"size": {"shortest_edge": 3136, "longest_edge": 40000}}),
         (4, 480, 640, {"size": {"shortest_edge": 3136, "longest_edge": 786432},
                        "cap_pixels_per_frame": True, "max_video_tokens": 40}),
         (2, 20, 700, {}),
         (6, 64, 64, {"resample": 2})]
LOGITS_ATOL = 1e-4  # as test_qwen_vl_read


def clip_of(frames: int, height: int, width: int) -> list[Image.Image]:
    return [Image.fromarray(array).resize((width, height)) for array in photos(frames, size=64)]


def read_back(theirs, rule: str, patch: int, folder: Path) -> VideoProcessor:
    """Ours, read from the folder transformers' processor saved itself to."""
    theirs.save_pretrained(folder)
    settings, path = video_processor_settings(folder)
    return VideoProcessor.from_transformers(settings, rule, multiple=patch * 2, temporal=2,
                                            source=path)


def frames_of(patches: torch.Tensor, grid: list[int], patch: int) -> torch.Tensor:
    """transformers' flattened patches `[t * h * w, 3 * 2 * p * p]` as frames `[T, 3, H, W]`
    (its `patchify` undone: temporal patches of 2, 2 x 2 merge)."""
    steps, rows, cols = grid
    x = patches.view(steps, rows // 2, cols // 2, 2, 2, 3, 2, patch, patch)
    return x.permute(0, 6, 5, 1, 3, 7, 2, 4, 8).reshape(steps * 2, 3, rows * patch,
                                                         cols * patch)


@pytest.mark.parametrize("rule", sorted(CLASSES))
@pytest.mark.parametrize(("frames", "height", "width", "settings"), CASES,
                         ids=["grow", "shrink", "odd", "cap", "thin", "bilinear"])
def test_the_pixels_are_transformers_video_processor_s(tmp_path, rule, frames, height, width,
                                                       settings):
    name, patch = CLASSES[rule]
    theirs = getattr(transformers, name)(**settings)
    ours = read_back(theirs, rule, patch, tmp_path)
    clip = clip_of(frames, height, width)
    cap = {} if "cap_pixels_per_frame" in settings else {"cap_pixels_per_frame": False}
    encoded = theirs(videos=[clip], do_sample_frames=False, return_tensors="pt", **cap)
    grid = encoded["video_grid_thw"][0].tolist()
    expected = frames_of(encoded["pixel_values_videos"], grid, patch)
    mine = ours(clip, ImageProcessor())
    assert ours.size(frames, height, width) == tuple(mine.shape[2:])
    assert (height, width) != tuple(mine.shape[2:])  # every case resizes
    padded = torch.cat([mine, mine[-1:].expand(-frames % 2, -1, -1, -1)])  # theirs is
    torch.testing.assert_close(padded, expected, rtol=0, atol=0)  # measured: bit-identical


@pytest.mark.parametrize("where", ["nested", "alone", "image_fallback"])
def test_the_settings_are_read_from_where_transformers_reads_them(tmp_path, where):
    """`processor_config.json`'s nested `video_processor` first, then
    `video_preprocessor_config.json`, then the image processor's file; Qwen2-VL's older
    `min_pixels` / `max_pixels` win over `size`."""
    settings = {"min_pixels": 5000, "max_pixels": 90000, "image_mean": [0.1, 0.2, 0.3],
                "image_std": [0.4, 0.5, 0.6], "cap_pixels_per_frame": True,
                "max_video_tokens": 99, "size": {"shortest_edge": 1, "longest_edge": 2}}
    decoy = {"size": {"shortest_edge": 7, "longest_edge": 8}}
    files = {"nested": {"processor_config.json": {"video_processor": settings},
                        "video_preprocessor_config.json": decoy},
             "alone": {"video_preprocessor_config.json": settings,
                       "preprocessor_config.json": decoy},
             "image_fallback": {"preprocessor_config.json": settings}}[where]
    for file, content in files.items():
        (tmp_path / file).write_text(json.dumps(content))
    theirs = transformers.Qwen2VLVideoProcessor.from_pretrained(tmp_path)
    found, path = video_processor_settings(tmp_path)
    ours = VideoProcessor.from_transformers(found, "qwen2_vl", multiple=28, temporal=2,
                                            source=path)
    assert (ours.min_pixels, ours.max_pixels) == (theirs.size["shortest_edge"],
                                                  theirs.size["longest_edge"]) == (5000, 90000)
    assert list(ours.mean) == list(theirs.image_mean) and list(ours.std) == list(theirs.image_std)
    assert (ours.cap_pixels_per_frame, ours.max_video_tokens) == (
        theirs.cap_pixels_per_frame, theirs.max_video_tokens) == (True, 99)


@pytest.mark.parametrize("rule", sorted(CLASSES))
def test_what_a_file_leaves_out_is_transformers_class_default(tmp_path, rule):
    """A file with only the older pixel keys: Qwen2-VL's class reads them, Qwen3-VL's
    ignores them; everything else is the class's default, ours as transformers'."""
    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps({"min_pixels": 5000, "max_pixels": 6000}))
    name, patch = CLASSES[rule]
    theirs = getattr(transformers, name).from_pretrained(tmp_path)
    found, path = video_processor_settings(tmp_path)
    ours = VideoProcessor.from_transformers(found, rule, multiple=2 * patch, temporal=2,
                                            source=path)
    assert (ours.min_pixels, ours.max_pixels) == (theirs.size["shortest_edge"],
                                                  theirs.size["longest_edge"])
    assert ((ours.min_pixels, ours.max_pixels) == (5000, 6000)) == (rule == "qwen2_vl")
    assert list(ours.mean) == list(theirs.image_mean)
    assert list(ours.std) == list(theirs.image_std)
    assert ours.max_video_tokens == theirs.max_video_tokens
    assert ours.resample == "bicubic" and theirs.resample == 3
    assert ours.cap_pixels_per_frame is False and theirs.cap_pixels_per_frame is None


@pytest.mark.parametrize(("change", "message"), [
    ({"do_normalize": False}, "do_normalize False"),
    ({"rescale_factor": 1.0}, "rescale_factor 1.0 is not 1/255"),
    ({"resample": 0}, "resample 0 is not bilinear"),
    ({"size": {"shortest_edge": 10, "longest_edge": 5}}, "min_pixels 10 is more than max_pixels 5"),
])
def test_settings_vlm_vit_cannot_follow_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=f"video_preprocessor_config.json: {message}"):
        VideoProcessor.from_transformers(change, "qwen3_vl", multiple=32, temporal=2,
                                         source="video_preprocessor_config.json")


def test_clips_that_cannot_be_sized_are_refused_by_name(monkeypatch):
    ours = VideoProcessor("qwen3_vl", 32, 2, 256, 1 << 20, (0.5,) * 3, (0.5,) * 3)
    frames = clip_of(2, 40, 40)
    with pytest.raises(ValueError, match="clip: a clip of 1 frame.* fewer than a temporal "
                                         "patch .2 frames."):
        ours(frames[:1], ImageProcessor())
    with pytest.raises(ValueError, match=r"clip: the frames of a clip must share one size, "
                                         r"got 2 sizes \[\(40, 40\), \(40, 48\)\]"):
        ours([frames[0], frames[1].resize((48, 40))], ImageProcessor())
    with pytest.raises(ValueError, match="clip: a clip without frames"):
        ours([], ImageProcessor())
    decoded = []
    counting = ImageProcessor()
    object.__setattr__(counting, "load", lambda frame, name: decoded.append(name) or frame)
    monkeypatch.setattr("vlm_vit_llm.video_processor.MAX_CLIP_PIXELS", 2 * 40 * 40)
    with pytest.raises(ValueError, match=r"clip: its first 3 frames hold 4800 decoded pixels, "
                                         r"more than a clip may \(3200, MAX_CLIP_PIXELS\)"):
        ours(clip_of(4, 40, 40), counting)
    assert len(decoded) == 3  # the fourth frame is never decoded
    with pytest.raises(ValueError, match="aspect ratio 250, more than 200"):
        ours.size(2, 4, 1000)


# -- through MultimodalLM --------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen(request, tmp_path_factory):
    from test_qwen_vl_read import qwen_folder

    folder = tmp_path_factory.mktemp(request.param)
    hf, processor = qwen_folder(folder, request.param)
    return request.param, folder, hf, processor, MultimodalLM.from_pretrained(folder)


def test_a_clip_of_frames_to_resize_gives_transformers_pixels_and_logits(qwen):
    """Frames of 44 x 60 are resized by the folder's video processor (Qwen2.5-VL: per frame
    to 48 x 64; Qwen3-VL: over the clip's 4 frames to 16 x 32, where 2 would give 32 x 48)
    with its filter: transformers' pixels exactly, where the image processor's resize
    (PIL's) is not."""
    from vlm_vit_llm.pixels import as_pixels

    family, folder, hf, processor, ours = qwen
    clip = clip_of(4, 44, 60)
    prompt = "<|vision_start|><|video_pad|><|vision_end|>what happens"
    metadata = {"fps": 2.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3]}
    encoded = processor(text=[prompt], videos=[clip], video_metadata=[metadata],
                        do_sample_frames=False, return_tensors="pt")
    grid = encoded["video_grid_thw"][0].tolist()
    assert grid == [2] + {"qwen2_5_vl": [6, 8], "qwen3_vl": [2, 4]}[family]
    expected = frames_of(encoded["pixel_values_videos"], grid, 8)
    pixels = as_pixels(Video(clip, 2.0), ours.tower, ours.processor, 0, ours.video_processor)
    torch.testing.assert_close(pixels.frames, expected, rtol=0, atol=0)
    as_images = torch.stack([ours.processor.preprocess_one(frame) for frame in clip])
    assert as_images.shape != expected.shape or not torch.equal(as_images, expected)
    batch = ours.prepare([prompt], [[Video(clip, 2.0)]])
    assert torch.equal(batch.input_ids, encoded["input_ids"])
    with torch.no_grad():
        theirs, mine = hf(**encoded).logits, ours.run(batch).logits
    torch.testing.assert_close(mine, theirs, rtol=0, atol=LOGITS_ATOL)


def test_a_sampled_video_gives_transformers_ids_positions_and_logits(qwen):
    """30 frames at 10 fps, sampled by `VideoProcessor.sample` as transformers' processor
    samples them (do_sample_frames): Qwen3-VL keeps 6 evenly from first to last and writes
    their times; Qwen2.5-VL keeps 6 at 2 fps and spaces its positions by that rate."""
    import numpy as np

    family, folder, hf, processor, ours = qwen
    base = photos(1, size=48)[0]
    video = [Image.fromarray(np.roll(base, 3 * step, axis=1)) for step in range(30)]
    prompt = "<|vision_start|><|video_pad|><|vision_end|>what happens"
    encoded = processor(text=[prompt], videos=[video], do_sample_frames=True,
                        video_metadata=[{"fps": 10.0, "total_num_frames": 30}],
                        return_tensors="pt")
    sampled = ours.video_processor.sample(Video(video, 10.0))
    assert len(sampled.frames) == 6 and encoded["video_grid_thw"][0, 0] == 3
    expected = {"qwen2_5_vl": (None, 2.0), "qwen3_vl": ((0, 6, 12, 17, 23, 29), 10.0)}
    assert (sampled.indices, sampled.fps) == expected[family]
    batch = ours.prepare([prompt], [[sampled]])
    assert torch.equal(batch.input_ids, encoded["input_ids"])  # Qwen3-VL: the times as text
    extra = {key: encoded[key] for key in ("second_per_grid_ts",) if key in encoded}
    theirs_ids, _ = hf.model.get_rope_index(
        encoded["input_ids"], encoded["mm_token_type_ids"],
        video_grid_thw=encoded["video_grid_thw"], attention_mask=encoded["attention_mask"],
        **extra)
    assert torch.equal(batch.position_ids, theirs_ids)
    with torch.no_grad():
        theirs, mine = hf(**encoded).logits, ours.run(batch).logits
    torch.testing.assert_close(mine, theirs, rtol=0, atol=LOGITS_ATOL)


def test_sampling_what_cannot_be_sampled_is_refused_by_name(qwen):
    family, folder, hf, processor, ours = qwen
    with pytest.raises(ValueError, match="sample takes a whole video's frames, got none"):
        ours.video_processor.sample(Video([], 10.0))
    frames = clip_of(4, 32, 32)
    with pytest.raises(ValueError, match="got frames already sampled"):
        ours.video_processor.sample(Video(frames, 10.0, (0, 1, 2, 3)))
    message = {"qwen3_vl": r"needs one frame index \(an int >= 0\) per frame, got "
                           r"\[0, 1, -2, 3\]",
               "qwen2_5_vl": "Qwen2.5-VL spaces a clip's temporal patches by its frames' "
                             "rate, not their indices"}[family]
    with pytest.raises(ValueError, match=message):
        ours.prepare(["<|vision_start|><|video_pad|><|vision_end|>"],
                     [[Video(frames, 10.0, (0, 1, -2, 3))]])
    if family == "qwen2_5_vl":  # Qwen3-VL keeps its one frame, which sizing refuses
        with pytest.raises(ValueError, match=r"a video of 1 frame\(s\) at 10 fps keeps no "
                                             r"temporal patch of 2 frames at 2 a second"):
            ours.video_processor.sample(Video(frames[:1], 10.0))


def test_the_video_processor_is_written_back_and_saved(qwen, tmp_path):
    """`llm export` writes it as transformers' video processor, which transformers reads with
    our settings; `save_pretrained` keeps it too."""
    from vlm_vit_llm.qwen_vl_writer import export_qwen_vl

    family, folder, hf, processor, ours = qwen
    export_qwen_vl(ours, tmp_path / "export")
    theirs = transformers.AutoProcessor.from_pretrained(tmp_path / "export").video_processor
    assert theirs.size["shortest_edge"] == ours.video_processor.min_pixels
    assert theirs.size["longest_edge"] == ours.video_processor.max_pixels
    assert MultimodalLM.from_pretrained(tmp_path / "export").video_processor == \
        ours.video_processor
    ours.save_pretrained(tmp_path / "saved")
    assert MultimodalLM.from_pretrained(tmp_path / "saved").video_processor == \
        ours.video_processor


def test_a_folder_whose_video_processor_cannot_be_read_is_one_line(qwen, tmp_path):
    family, folder, hf, processor, ours = qwen
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    nested = json.loads((copy / "processor_config.json").read_text())
    nested["video_processor"]["do_normalize"] = False
    (copy / "processor_config.json").write_text(json.dumps(nested))
    with pytest.raises(ValueError, match=r"processor_config.json: do_normalize False: "
                                         r"vlm-vit reads Qwen's video processor"):
        MultimodalLM.from_pretrained(copy)


def test_our_own_layout_keeps_a_video_processor(tmp_path, tokenizer):
    """A non-Qwen LLM with a temporal tower saves its video processor in
    `multimodal_config.json`; the temporal patch must be the tower's."""
    from test_llm_video import video_mm

    from vlm_vit_llm.saving import CONFIG_NAME

    plain = video_mm(tmp_path, tokenizer)
    video = VideoProcessor("qwen2_vl", 8, 2, 64, 64 * 64, (0.5,) * 3, (0.5,) * 3)
    mm = MultimodalLM(plain.tower, plain.llm, plain.tokenizer, processor=plain.processor,
                      video_processor=video)
    clip = clip_of(3, 20, 28)
    assert mm.prepare(["<image> what"], [[Video(clip)]]).input_ids.shape[1] > 10
    mm.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / CONFIG_NAME).read_text())["video_processor"][
        "rule"] == "qwen2_vl"
    assert MultimodalLM.from_pretrained(tmp_path / "saved").video_processor == video
    with pytest.raises(ValueError, match="the video processor's temporal patch is 3 frames, "
                                         "but the tower's temporal_patch_size is 2"):
        MultimodalLM(plain.tower, plain.llm, plain.tokenizer, processor=plain.processor,
                     video_processor=VideoProcessor("qwen2_vl", 8, 3, 64, 4096, (0.5,) * 3,
                                                    (0.5,) * 3))



@pytest.mark.filterwarnings("ignore:The tied weights mapping")
def test_llm_train_sizes_a_video_record_by_the_folder_s_video_processor(qwen, tmp_path,
                                                                        capsys, monkeypatch):
    """`llm train THEIR_FOLDER --stage 2 --packing` on a record with a clip (its frames'
    files) and one with an image: the clip goes through the folder's video processor."""
    from vlm_vit.cli import main

    family, folder, hf, processor, ours = qwen
    seen = []
    real = VideoProcessor.__call__

    def spied(self, frames, decoder, name="clip"):
        pixels = real(self, frames, decoder, name)
        seen.append((self, tuple(pixels.shape)))
        return pixels

    monkeypatch.setattr(VideoProcessor, "__call__", spied)
    (tmp_path / "images").mkdir()
    for index, frame in enumerate(clip_of(4, 44, 60)):
        frame.save(tmp_path / "images" / f"{index}.png")
    records = [{"id": "clip", "video": [f"{index}.png" for index in range(4)],
                "conversations": [{"from": "human", "value": "<image>\nwhat happens"},
                                  {"from": "gpt", "value": "a red square moves"}]},
               {"id": "photo", "image": "0.png",
                "conversations": [{"from": "human", "value": "<image>\nwhat is it"},
                                  {"from": "gpt", "value": "a red square"}]}]
    (tmp_path / "data.json").write_text(json.dumps(records))
    assert main(["llm", "train", str(folder), "--stage", "2", "--lora-r", "4", "--packing",
                 "--data-format", "llava", "--data", str(tmp_path / "data.json"),
                 "--image-folder", str(tmp_path / "images"), "--steps", "1",
                 "--batch-size", "2", "--num-workers", "0", "--device", "cpu", "--quiet",
                 "--out", str(tmp_path / "s2")]) == 0
    assert "trained stage 2 for 1 steps" in capsys.readouterr().out
    side = {"qwen2_5_vl": (48, 64), "qwen3_vl": (16, 32)}[family]
    assert seen and all(video == ours.video_processor and shape == (4, 3, *side)
                        for video, shape in seen)


def test_llm_embed_sizes_a_clip_by_the_video_processor(qwen):
    """`image_embeddings` (what `llm embed` writes) of a clip: transformers' grid and its
    video features (the merger's). Qwen3-VL's clip of several temporal patches needs its
    timestamps, so it is refused by name there."""
    from vlm_vit_llm.embeddings import image_embeddings

    family, folder, hf, processor, ours = qwen
    clip = clip_of(4, 44, 60)
    if family == "qwen3_vl":
        with pytest.raises(ValueError, match="Qwen3-VL writes a timestamp before each "
                                             "temporal patch"):
            image_embeddings(ours, [Video(clip, 2.0)])
        return
    encoded = processor(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[clip],
                        video_metadata=[{"fps": 2.0, "total_num_frames": 4,
                                         "frames_indices": [0, 1, 2, 3]}],
                        do_sample_frames=False, return_tensors="pt")
    embedded = image_embeddings(ours, [Video(clip, 2.0)])
    assert torch.equal(embedded.tensors["video_grid_thw"], encoded["video_grid_thw"])
    with torch.no_grad():
        theirs = hf.model.get_video_features(encoded["pixel_values_videos"],
                                             encoded["video_grid_thw"])
    merged = torch.cat(list(theirs.pooler_output))
    width = merged.shape[-1]
    torch.testing.assert_close(embedded.tensors["video_embeds"][:, :width], merged,
                               rtol=0, atol=1e-5)


def test_a_qwen_folder_reads_by_its_hub_name_from_the_cache(qwen, tmp_path, monkeypatch):
    """A Hub name of a cached Qwen-VL snapshot reads as the folder does: the same logits on
    an image and a clip, the same video processor."""
    from vlm_vit.testing import offline_hub_cache, put_in_hub_cache

    family, folder, hf, processor, ours = qwen
    cache = offline_hub_cache(tmp_path / "hf_home", monkeypatch)
    put_in_hub_cache(cache, f"Qwen/tiny-{family}", folder)
    named = MultimodalLM.from_pretrained(f"Qwen/tiny-{family}")
    assert named.video_processor == ours.video_processor
    prompt = ("<|vision_start|><|image_pad|><|vision_end|>and "
              "<|vision_start|><|video_pad|><|vision_end|>what happens")
    images = [[Image.fromarray(photos(1, size=40)[0]), Video(clip_of(4, 44, 60), 2.0)]]
    with torch.no_grad():
        torch.testing.assert_close(named.run(named.prepare([prompt], images)).logits,
                                   ours.run(ours.prepare([prompt], images)).logits,
                                   rtol=0, atol=0)


def test_a_video_processor_of_the_other_family_is_not_written(qwen, tmp_path, monkeypatch):
    """transformers' class of the family sizes clips by its own rule: a video processor of
    the other rule cannot be written as it, and nothing is."""
    from dataclasses import replace

    from vlm_vit_llm.qwen_vl_writer import export_qwen_vl

    family, folder, hf, processor, ours = qwen
    other = {"qwen2_5_vl": "qwen3_vl", "qwen3_vl": "qwen2_vl"}[family]
    monkeypatch.setattr(ours, "video_processor", replace(ours.video_processor, rule=other))
    with pytest.raises(ValueError, match=f"the video processor sizes clips by the {other} rule, "
                                         f"but {family}'s video processor by the"):
        export_qwen_vl(ours, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_the_embed_command_takes_clips_and_samples_them(qwen, tmp_path, capsys):
    """`vlm-vit embed MODEL IMAGE --video FRAME... --fps R [--sample]`: the clip after the
    image, as `image_embeddings` gives it (Qwen2.5-VL: vLLM's video input; Qwen3-VL refuses a
    clip of several temporal patches, whose times are text); bad flags are one line."""
    from vlm_vit.cli import main
    from vlm_vit_llm.embeddings import image_embeddings, load_embeddings

    family, folder, hf, processor, ours = qwen
    frames = clip_of(6, 44, 60)
    for index, frame in enumerate(frames):
        frame.save(tmp_path / f"{index}.png")
    Image.fromarray(photos(1, size=40)[0]).save(tmp_path / "photo.png")
    paths = [str(tmp_path / f"{index}.png") for index in range(6)]
    out = tmp_path / "embeds.safetensors"
    code = main(["embed", str(folder), str(tmp_path / "photo.png"), "--video", *paths,
                 "--fps", "3", "--sample", "--out", str(out)])
    if family == "qwen3_vl":
        assert code == 1 and "Qwen3-VL writes a timestamp" in capsys.readouterr().err
        return
    assert code == 0 and "1 image(s), 1 clip(s)" in capsys.readouterr().out
    sampled = ours.video_processor.sample(Video(frames, 3.0))  # 4 of 6 frames at 2 a second
    assert len(sampled.frames) == 4 and sampled.fps == 2.0
    expected = image_embeddings(ours, [tmp_path / "photo.png", sampled])
    read = load_embeddings(out)
    assert read.metadata["videos"] == "[1]"
    for name, tensor in expected.tensors.items():
        torch.testing.assert_close(read.tensors[name], tensor, rtol=0, atol=0)
    for arguments, message in [
            ([], "give IMAGE files or --video FRAME"),
            ([str(tmp_path / "photo.png"), "--fps", "2"], "--fps 2: a positive frame rate, "
                                                          "for --video clips"),
            (["--video", *paths, "--fps", "-1"], "--fps -1"),
            (["--video", paths[0], str(tmp_path / "nope.png")], "nope.png does not exist")]:
        assert main(["embed", str(folder), *arguments, "--out", str(tmp_path / "x")]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "x").exists()
