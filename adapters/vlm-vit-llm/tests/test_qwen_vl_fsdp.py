"""A Qwen2.5-VL folder read from transformers trains in stage 2 under FSDP2 as under DDP
(issue 44): two gloo processes, packed rows with M-RoPE, LoRA on the LLM and the encoder,
FSDP2 with activation checkpointing and a resume from its sharded checkpoint; the same
losses and the same saved model."""

import pytest
from test_llm_fsdp import LR, assert_same_run, launch, write_conversations
from test_qwen_vl_read import qwen_folder


@pytest.mark.slow  # the two-process launch
def test_fsdp_trains_a_qwen_folder_as_ddp_and_resumes(tmp_path):
    folder = tmp_path / "qwen2_5_vl"
    qwen_folder(folder, "qwen2_5_vl")
    data = write_conversations(tmp_path, {i for i in range(16) if i % 4 == 3}, 16)
    common = {"lr": LR, "data": str(data), "images": str(tmp_path / "images"),
              "model": str(folder), "stage": 2, "steps": 4, "packing": True}
    launch(tmp_path, {"tokenizer": "", "runs": [
        {**common, "strategy": "ddp", "run_dir": str(tmp_path / "ddp")},
        {**common, "strategy": "fsdp", "run_dir": str(tmp_path / "fsdp"), "split": 2,
         "grad_checkpointing": True}]})
    assert any((tmp_path / "fsdp" / "checkpoints").glob("step_00000002/__1_0.distcp"))
    assert_same_run(tmp_path / "fsdp", tmp_path / "ddp")
