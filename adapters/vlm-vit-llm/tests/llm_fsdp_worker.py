"""One process of the bridge's multi-process tests: `torchrun ... llm_fsdp_worker.py SPEC.json`.

SPEC names the tokenizer and a list of runs; each run names its conversations file and image
folder ("data", "images"), trains a tiny bridge (`conftest.tiny_tower`, `tiny_llm`; or with
"model", a transformers Qwen-VL folder read by `MultimodalLM.from_pretrained`) on them
with `ConversationObjective` and writes RUN_DIR/model/ (the export) and, from rank 0,
RUN_DIR/losses.json. A run with "split" trains that many steps first, then resumes from that
run's distributed checkpoint on a model built afresh, up to "steps". "packing" packs each
batch's records into rows; "grad_checkpointing" recomputes activations in backward; "tiled"
tiles every image (AnyRes, `test_llm_anyres.PINPOINTS`).

The process group is set up here, once, so that one launch trains every run (the trainer
leaves a group it did not create in place).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import perturb_lora, tiny_llm, tiny_tower  # noqa: E402

from vlm_vit.train import TrainConfig, Trainer  # noqa: E402
from vlm_vit_llm import MultimodalLM  # noqa: E402
from vlm_vit_llm.records import ConversationRecords  # noqa: E402
from vlm_vit_llm.train import (  # noqa: E402
    ConversationCollate,
    ConversationDataset,
    ConversationObjective,
)


def bridge(tokenizer, stage: str, llm_seed: int = 0, tiled: bool = False
           ) -> ConversationObjective:
    """A tiny bridge set up for `stage` ("projector", or "lora" on the LLM and the encoder),
    the same on every rank and every call; the loss is each record's mean, then the mean
    over records (so two ranks' equal shares average to one process's whole batch)."""
    tower = tiny_tower()
    if tiled:
        from test_llm_anyres import PINPOINTS

        from vlm_vit import VisionTower
        from vlm_vit.processor import Tiling

        tower = VisionTower(tower.encoder, tower.pooler, feature_layer=-2,
                            tiling=Tiling(pinpoints=PINPOINTS, tile_size=32))
    mm = MultimodalLM(tower, tiny_llm(vocab_size=512, seed=llm_seed), tokenizer)
    if stage == "projector":
        mm.train_projector_only()
    else:
        torch.manual_seed(0)
        mm.add_lora(r=4, encoder_targets="attn")  # the encoder trains too
        perturb_lora(mm)  # LoRA starts as a no-op; make it count from the first step
    return ConversationObjective(mm, loss_reduction="record")


def read_bridge(folder: str) -> ConversationObjective:
    """A model read from a transformers folder (Qwen-VL), LoRA on its LLM and encoder."""
    mm = MultimodalLM.from_pretrained(folder)
    torch.manual_seed(0)
    mm.add_lora(r=4, encoder_targets="attn_qv")
    perturb_lora(mm, hold_key_rows=True)
    return ConversationObjective(mm.train(), loss_reduction="record")


def train(spec: dict, run: dict, steps: int, resume: bool) -> list[float]:
    """Trains (or resumes) one run of `spec` for `steps` steps in total; its losses. A run
    with "model" reads that transformers folder (stage 2) instead of the tiny bridge."""
    from transformers import LlamaTokenizer

    from vlm_vit_llm.readers import record_placeholder

    if run.get("model"):
        objective = read_bridge(run["model"])
        placeholder, image_text = record_placeholder(Path(run["model"]))
    else:
        objective = bridge(LlamaTokenizer.from_pretrained(spec["tokenizer"]),
                           "projector" if run["stage"] == 1 else "lora",
                           tiled=run.get("tiled", False))
        placeholder, image_text = "<image>", None
    mm = objective.mm
    collate = ConversationCollate(mm, template="vicuna_v1", packing=run.get("packing", False))
    dataset = ConversationDataset(ConversationRecords(run["data"], run["images"],
                                                      image_token=placeholder,
                                                      image_text=image_text),
                                  mm.processor, image_tokens=collate.image_tokens,
                                  least_image_tokens=collate.least_image_tokens)
    lr = run["lr"]  # constant (min_lr = lr): a split run follows the whole one
    config = TrainConfig(steps=steps, batch_size=4, lr=lr, min_lr=lr, warmup_steps=0,
                         weight_decay=0.0, num_workers=0, checkpoint_every=0, log_every=100,
                         device="cpu", strategy=run["strategy"],
                         grad_checkpointing=run.get("grad_checkpointing", False))
    return Trainer(objective, dataset, config, run["run_dir"], collate=collate,
                   progress=False).fit(resume=resume).losses


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for run in spec["runs"]:
        if run.get("split"):
            train(spec, run, run["split"], resume=False)
        losses = train(spec, run, run["steps"], resume=bool(run.get("split")))
        if dist.get_rank() == 0:
            (Path(run["run_dir"]) / "losses.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
