"""The LLM bridge (`vlm_vit_llm.MultimodalLM`) against Hugging Face's
`LlavaForConditionalGeneration` on the same weights: a forward pass and a LLaVA stage-1
training step (projector only).

    python benchmarks/llava_step_vs_hf.py                  # clip-vit-b/16 + a 4-layer Llama
    python benchmarks/llava_step_vs_hf.py --variant clip-vit-l/14-336 --llm-width 1024

The anchor is our model exported with `export_llava` and loaded by transformers, so the
weights are identical (the logits are checked). Our side includes tokenising and expanding
the prompts on every call; transformers gets the expanded ids ready-made. The two alternate
in one process after a warm-up (medians); the step's peak memory (activations and gradients,
after a first step) is measured per library in a child process. Needs the plugin:
`pip install -e adapters/vlm-vit-llm`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from timing import (  # noqa: E402
    alternate,
    flush_denormals,
    peak_memory_in_child,
    peak_memory_mib,
    write_json,
)

from vlm_vit import EncoderConfig, VisionEncoder, VisionTower, build_pooler  # noqa: E402

CAPTION = "a photo of a small dog that runs over the green grass in the park"


def tokenizer_in(folder: Path):
    """A small SentencePiece tokenizer trained here (no download)."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    text = folder / "corpus.txt"
    text.write_text("\n".join([CAPTION, "describe the image", "what is in the picture"] * 50))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / "sp"),
                                   vocab_size=60, model_type="bpe", unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, minloglevel=2)
    (folder / "sp.model").rename(folder / "tokenizer.model")
    return LlamaTokenizer.from_pretrained(folder)


def build(args: argparse.Namespace, folder: Path):
    """(our model, transformers' LLaVA on the same weights), both in stage-1 set-up."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlavaForConditionalGeneration
    from vlm_vit_llm import MultimodalLM, export_llava

    torch.manual_seed(0)
    config = EncoderConfig.from_name(args.variant, **({"image_size": args.image_size}
                                                       if args.image_size else {}))
    encoder = VisionEncoder(config).eval()
    width = args.llm_width
    tower = VisionTower(encoder, build_pooler("mlp2x_gelu", in_dim=encoder.config.width,
                                              out_dim=width), feature_layer=-2)
    llm = LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=width, intermediate_size=width * 11 // 4,
        num_hidden_layers=args.llm_layers, num_attention_heads=width // 64,
        num_key_value_heads=width // 64, max_position_embeddings=2048)).eval()
    mm = MultimodalLM(tower, llm, tokenizer_in(folder))
    export_llava(mm, folder / "llava")
    hf = LlavaForConditionalGeneration.from_pretrained(folder / "llava").eval()
    mm.train_projector_only()
    hf.requires_grad_(False)
    hf.model.multi_modal_projector.requires_grad_(True)
    return mm, hf


def inputs(mm, batch_size: int, image_size: int):
    torch.manual_seed(1)
    pixels = torch.randn(batch_size, 3, image_size, image_size)
    prompts, images = ["<image>\n"] * batch_size, [[p] for p in pixels]
    targets = [CAPTION] * batch_size
    batch = mm.prepare(prompts, images, targets)
    hf_inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                     pixel_values=pixels, labels=batch.labels)
    return (prompts, images, targets), hf_inputs


def calls(mm, hf, ours_inputs, hf_inputs):
    prompts, images, targets = ours_inputs
    optimizers = {name: torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                          lr=1e-4) for name, model in
                  (("vlm-vit-llm", mm), ("transformers", hf))}

    def forward_ours():  # prompt and caption, with the loss, as in a step
        with torch.inference_mode():
            return mm(prompts, images, targets).logits

    def forward_hf():
        with torch.inference_mode():
            return hf(**hf_inputs).logits

    def step(name, run):
        def go():
            loss = run().loss
            optimizers[name].zero_grad(set_to_none=True)
            loss.backward()
            optimizers[name].step()
            return loss.item()
        return go

    steps = {"vlm-vit-llm": step("vlm-vit-llm", lambda: mm(prompts, images, targets)),
             "transformers": step("transformers", lambda: hf(**hf_inputs))}
    return {"vlm-vit-llm": forward_ours, "transformers": forward_hf}, steps


def child(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        mm, hf = build(args, Path(scratch))
        ours_inputs, hf_inputs = inputs(mm, args.batch_size, mm.tower.encoder.config.image_size[0])
        _, steps = calls(mm, hf, ours_inputs, hf_inputs)
        step = steps[args.child]
        del mm, hf
        step()  # first-call work (lazy imports, optimizer state) is not the step's memory
        print(peak_memory_mib(lambda: (step(), step()), "cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="clip-vit-b/16")
    parser.add_argument("--image-size", type=int, default=None, help="default: the variant's")
    parser.add_argument("--llm-width", type=int, default=512)
    parser.add_argument("--llm-layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush denormal floats to zero (see timing.flush_denormals)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    flush_denormals(args.keep_denormals)
    if args.child:
        child(args)
        return

    with tempfile.TemporaryDirectory() as scratch:
        mm, hf = build(args, Path(scratch))
        size = mm.tower.encoder.config.image_size[0]
        ours_inputs, hf_inputs = inputs(mm, args.batch_size, size)
        forwards, steps = calls(mm, hf, ours_inputs, hf_inputs)
        difference = (forwards["vlm-vit-llm"]() - forwards["transformers"]()).abs().max().item()
        forward = alternate(forwards, args.repeats)
        step = alternate(steps, args.repeats)
    result = {
        "variant": args.variant, "llm_width": args.llm_width, "llm_layers": args.llm_layers,
        "batch_size": args.batch_size, "image_tokens": mm.tower.num_image_tokens(),
        "max_abs_logit_difference": difference,
        "forward_seconds": forward, "step_seconds": step,
        "forward_ratio_vlm_vit_over_transformers":
            forward["vlm-vit-llm"] / forward["transformers"],
        "step_ratio_vlm_vit_over_transformers": step["vlm-vit-llm"] / step["transformers"],
        # Speed ratios (above 1: we are faster), as the suite's table reads them.
        "forward_speed_ratio_vlm_vit_over_transformers":
            forward["transformers"] / forward["vlm-vit-llm"],
        "step_speed_ratio_vlm_vit_over_transformers": step["transformers"] / step["vlm-vit-llm"],
    }
    if not args.no_memory:
        size = ["--image-size", str(args.image_size)] if args.image_size else []
        base = ["--variant", args.variant, *size, "--llm-width", str(args.llm_width),
                "--llm-layers", str(args.llm_layers), "--batch-size", str(args.batch_size)]
        memory = {name: peak_memory_in_child(__file__, [*base, "--child", name])
                  for name in steps}
        result["step_peak_memory_mib"] = memory
        result["step_memory_ratio_vlm_vit_over_transformers"] = \
            memory["vlm-vit-llm"] / max(memory["transformers"], 1e-9)
    print(f"LLaVA, {args.variant} + Llama {args.llm_layers}x{args.llm_width}, batch "
          f"{args.batch_size}, cpu float32, median of {args.repeats} (max logit diff "
          f"{difference:.1e})")
    for name in steps:
        memory = result.get("step_peak_memory_mib", {}).get(name)
        extra = f", step peak memory {memory:7.0f} MiB" if memory is not None else ""
        print(f"  {name:<13} forward {forward[name]:7.3f} s, stage-1 step {step[name]:7.3f} s"
              f"{extra}")
    print(f"  ratios vlm-vit-llm / transformers: forward "
          f"{result['forward_ratio_vlm_vit_over_transformers']:.3f}, step "
          f"{result['step_ratio_vlm_vit_over_transformers']:.3f} (below 1: faster)")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
