"""Encode images and read every patch token.

    python examples/encode_patch_tokens.py                     # ViT-B/16 at random init
    python examples/encode_patch_tokens.py --checkpoint DIR    # your weights

Uses scikit-image's sample photos (pip install scikit-image), so it runs offline.
"""

import argparse

import torch
from PIL import Image

import vlm_vit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a saved encoder (default: random weights)")
    parser.add_argument("--variant", default="vit-b/16")
    parser.add_argument("--image-size", type=int, default=None)
    args = parser.parse_args()

    if args.checkpoint:
        encoder = vlm_vit.load_encoder(args.checkpoint)
    else:
        overrides = {"image_size": args.image_size} if args.image_size else {}
        encoder = vlm_vit.VisionEncoder(vlm_vit.EncoderConfig.from_name(args.variant,
                                                                       **overrides))
    encoder.eval()
    processor = vlm_vit.ImageProcessor(size=encoder.config.image_size)

    from skimage import data

    photos = [Image.fromarray(data.astronaut()), Image.fromarray(data.coffee())]
    pixels = processor(photos)  # [2, 3, H, W], normalised
    with torch.inference_mode():
        out = encoder(pixels, feature_layers=[-2])  # LLaVA's layer; stops before the last block
        final = encoder(pixels)

    rows, cols = final.grid
    print(f"pixels {list(pixels.shape)} -> grid {rows}x{cols}, {final.num_prefix_tokens} prefix")
    print(f"every token      {list(final.tokens.shape)}")
    print(f"patch tokens     {list(final.patch_tokens.shape)}")
    print(f"layer -2 (raw)   {list(out.features[0].shape)}")
    # Patch (r, c) of image i is final.patch_tokens[i, r * cols + c].
    print(f"top-left patch of image 0, first 4 channels: {final.patch_tokens[0, 0, :4].tolist()}")


if __name__ == "__main__":
    main()
