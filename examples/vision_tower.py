"""Build a LLaVA-style vision tower: layer -2, class token dropped, MLP projector to an LLM.

    python examples/vision_tower.py                        # CLIP ViT-L/14-336 shape, random
    python examples/vision_tower.py --pooler pixel_shuffle # any registered pooler

Prints, for each pooler asked, how many tokens an image becomes and their width.
"""

import argparse

import torch
from PIL import Image

import vlm_vit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="clip-vit-l/14-336")
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument("--llm-width", type=int, default=4096)
    parser.add_argument("--pooler", action="append", help="repeatable; default mlp2x_gelu")
    parser.add_argument("--save", help="save the tower to this directory and reload it")
    args = parser.parse_args()
    print("available poolers:", ", ".join(vlm_vit.available_poolers()))

    overrides = {"image_size": args.image_size} if args.image_size else {}
    encoder = vlm_vit.VisionEncoder(vlm_vit.EncoderConfig.from_name(args.variant, **overrides))
    processor = vlm_vit.ImageProcessor.for_family("clip", size=encoder.config.image_size)

    from skimage import data

    pixels = processor([Image.fromarray(data.astronaut())])
    for name in args.pooler or ["mlp2x_gelu"]:
        try:
            projector = vlm_vit.build_pooler(name, in_dim=encoder.config.width,
                                             out_dim=args.llm_width)
        except ValueError:  # poolers without weights keep the encoder's width
            projector = vlm_vit.build_pooler(name, in_dim=encoder.config.width)
        keep_prefix = getattr(projector, "requires_class_token", False)
        tower = vlm_vit.VisionTower(encoder, projector, feature_layer=-2,
                                    keep_prefix=keep_prefix).eval()
        with torch.inference_mode():
            image_tokens = tower(pixels)
        print(f"{name:>15}: image -> {list(image_tokens.shape)} "
              f"(num_image_tokens = {tower.num_image_tokens()})")
        if args.save:
            tower.save_pretrained(args.save)
            reloaded = vlm_vit.VisionTower.from_pretrained(args.save).eval()
            with torch.inference_mode():
                same = torch.equal(reloaded(pixels), image_tokens)
            print(f"{'':>15}  saved to {args.save} and reloaded: identical = {same}")


if __name__ == "__main__":
    main()
