"""SDPA per record (`vlm_vit_llm.varlen_attention`): packed records equal each record run
alone through transformers' sdpa, whether the boundaries come as `cu_seq_lens_q` or from the
positions, with padding segments and under gradient checkpointing; padded calls on the same
LLM are transformers' sdpa unchanged."""

import pytest
import torch
from conftest import tiny_llm

from vlm_vit_llm import varlen_attention
from vlm_vit_llm.packing import layout_rows, run_packed

MODELS = {"llama": dict(kind="llama"), "qwen2-tied": dict(kind="qwen2", tied=True)}
# Logits of the tiny LLMs reach ~60 (initializer_range 0.5); float32 kernels on other
# shapes agree to ~3e-7 of that, a leak moves them by whole units.
TOLERANCE = 1e-5


def records(count=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (count,), generator=generator).tolist()
    return [torch.randint(3, 120, (n,), generator=generator).tolist() for n in lengths]


def alone(llm, ids):
    ids = torch.tensor([ids])
    return llm(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]


def assert_close(got, expected, name):
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE * scale,
                               msg=lambda message: f"{name}: {message}")


def test_record_boundaries_from_restarting_positions():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    out = varlen_attention.record_boundaries(positions)
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 10, 12]
    assert out["cu_seq_lens_q"].dtype == torch.int32
    assert out["max_length_q"] == out["max_length_k"] == 4


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("one_row", [True, False], ids=["one-row", "rows-with-padding"])
@pytest.mark.parametrize("boundaries", [True, False], ids=["cu_seq_lens", "from-positions"])
def test_packed_logits_equal_records_alone(model, one_row, boundaries):
    llm = tiny_llm(**MODELS[model])
    sequences = records()
    layout = layout_rows(sequences, sequences, [[0, 2], [1, 3]], pad_id=0, one_row=one_row)
    with torch.no_grad():
        expected = [alone(llm, ids) for ids in sequences]  # on sdpa
        embeds = llm.get_input_embeddings()(layout["input_ids"])
        if boundaries:
            logits = run_packed(llm, embeds, layout["position_ids"], layout["record_index"],
                                "varlen_sdpa").logits
        else:
            varlen_attention.register()
            llm.set_attn_implementation(varlen_attention.NAME)
            logits = llm(inputs_embeds=embeds, position_ids=layout["position_ids"],
                         attention_mask=None, use_cache=False).logits
    assert llm.config._attn_implementation == varlen_attention.NAME
    for index, want in enumerate(expected):
        assert_close(logits[layout["record_index"] == index], want, f"record {index}")


def test_padded_calls_are_transformers_sdpa():
    """Right and left padding, and no padding: bit-identical to sdpa."""
    llm = tiny_llm()
    ids = torch.randint(3, 120, (3, 9), generator=torch.Generator().manual_seed(1))
    masks = [torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [0] * 4 + [1] * 5]),
             torch.ones(3, 9, dtype=torch.long)]
    with torch.no_grad():
        expected = [llm(input_ids=ids, attention_mask=mask).logits for mask in masks]
        varlen_attention.register()
        llm.set_attn_implementation(varlen_attention.NAME)
        got = [llm(input_ids=ids, attention_mask=mask).logits for mask in masks]
    for want, have, mask in zip(expected, got, masks, strict=True):
        torch.testing.assert_close(have[mask.bool()], want[mask.bool()], rtol=0, atol=0)


def test_gradients_under_gradient_checkpointing():
    """The recomputed forward (after `run_packed` has returned) still confines attention."""
    llm = tiny_llm().train()
    sequences = records(seed=3)
    llm.zero_grad()
    for ids in sequences:
        ids = torch.tensor([ids])
        llm(input_ids=ids, use_cache=False).logits.float().sum().backward()
    expected = {name: p.grad.clone() for name, p in llm.named_parameters()}
    llm.zero_grad()
    llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layout = layout_rows(sequences, sequences, [[0, 1, 2, 3]], pad_id=0, one_row=True)
    embeds = llm.get_input_embeddings()(layout["input_ids"])
    logits = run_packed(llm, embeds, layout["position_ids"], layout["record_index"],
                        "varlen_sdpa").logits
    logits.float().sum().backward()
    for name, p in llm.named_parameters():
        assert_close(p.grad, expected[name], name)


def test_a_sliding_window_is_refused():
    class Attention(torch.nn.Module):
        is_causal = True

    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="sliding_window=2"):
        varlen_attention.varlen_sdpa_forward(Attention(), q, q, q, None, sliding_window=2)
