"""Load a Hugging Face CLIP checkpoint and check it computes what transformers computes.

    python examples/load_hf_clip.py                 # a small random CLIPModel, written here
    python examples/load_hf_clip.py --dir CLIP_DIR  # your own save_pretrained directory

Needs `pip install 'vlm-vit[hf]'`. Runs offline: with no --dir it writes a random model.
"""

import argparse
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import vlm_vit  # noqa: E402

TOLERANCE = 1e-4  # our tower's image embeddings against CLIPModel.get_image_features


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="a CLIPModel save_pretrained directory")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    from transformers import CLIPConfig, CLIPModel

    directory = args.dir
    if directory is None:
        directory = tempfile.mkdtemp()
        config = CLIPConfig(
            vision_config=dict(hidden_size=args.width, intermediate_size=4 * args.width,
                               num_hidden_layers=args.layers, num_attention_heads=4,
                               image_size=224, patch_size=32),
            text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2), projection_dim=64)
        torch.manual_seed(0)
        CLIPModel(config).save_pretrained(directory)

    tower = vlm_vit.load_tower(directory).eval()  # encoder + CLIP's own projection
    processor = vlm_vit.load_processor(directory)
    reference = CLIPModel.from_pretrained(directory).eval()

    from skimage import data

    pixels = processor([data.astronaut(), data.coffee()])
    with torch.inference_mode():
        ours = tower(pixels)
        theirs = reference.get_image_features(pixel_values=pixels)
        theirs = getattr(theirs, "pooler_output", theirs)  # an output object in transformers 5
    print(f"loaded {directory}: {tower.encoder.config.depth} blocks, width "
          f"{tower.encoder.config.width}, act {tower.encoder.config.act}")
    difference = (ours - theirs).abs().max().item()
    print(f"image embeddings {list(ours.shape)}, max |ours - transformers| = "
          f"{difference:.2e}")
    if args.dir is None:
        shutil.rmtree(directory)
    if not difference <= TOLERANCE:
        print(f"our embeddings differ from transformers' by more than {TOLERANCE}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
