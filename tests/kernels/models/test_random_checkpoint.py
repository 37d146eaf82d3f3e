"""`write_checkpoint`: a random model of a named shape saved as a Hugging Face directory (the
GPU host carries no model files). Our loader and transformers must both read it, agree on
the weights, and its word-level tokenizer must encode and decode every id.

1. the config round-trips to the same ModelSpec (default and llama3 rope, tied and untied
   head, attention bias);
2. transformers' forward over the checkpoint equals ours (names, q/k/v and gate/up order);
3. the same seed writes the same bytes;
4. every id decodes (random weights sample any id), through transformers' tokenizer, the
   incremental detokenizer and the tokenizer actor's encode.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenloom.kernels.models.loader import load_model, load_spec, resolve_model_dir
from tokenloom.kernels.models.model_spec import RopeSpec
from tokenloom.kernels.models.random_model import SHAPES, token_names, write_checkpoint

TINY = SHAPES["tiny"]
# The 8B shape's rope, head and ids at a size a test can write.
SMALL_LLAMA3 = dataclasses.replace(SHAPES["llama3-8b"], num_layers=2, hidden_size=64,
                                   intermediate_size=96, num_heads=4, num_kv_heads=2,
                                   head_dim=16, vocab_size=128256)
# Llama's `attention_bias` covers o_proj as well as q/k/v.
BIASED = dataclasses.replace(TINY, attention_bias=True, o_bias=True, tie_word_embeddings=False,
                             rope=RopeSpec(theta=1e6, rope_type="linear", factor=2.0),
                             eos_token_ids=(2, 5))


@pytest.mark.parametrize("spec", [TINY, SMALL_LLAMA3, BIASED], ids=["tiny", "llama3", "biased"])
def test_config_round_trips_to_the_spec(tmp_path, spec):
    write_checkpoint(spec, tmp_path / "m", torch.float32, seed=0)
    assert load_spec(resolve_model_dir(str(tmp_path / "m"), tmp_path)) == spec


@pytest.mark.parametrize("spec", [TINY, BIASED], ids=["tiny", "biased"])
def test_transformers_and_our_loader_compute_the_same_logits(tmp_path, spec):
    from transformers import AutoModelForCausalLM

    from tokenloom.actors.execution.batch_inputs import build_batch_inputs
    from tokenloom.actors.messages import ExecuteBatch, ScheduledSequence
    from tokenloom.kernels.kv_store import KVCache
    path = tmp_path / "m"
    write_checkpoint(spec, path, torch.float32, seed=3, std=0.3)
    if spec.attention_bias:   # zero biases would not show a misplaced one: fill them in
        from safetensors.torch import load_file, save_file
        state = load_file(str(path / "model.safetensors"))
        g = torch.Generator().manual_seed(0)
        for k in state:
            if k.endswith(".bias"):
                state[k] = torch.randn(state[k].shape, generator=g)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    ids = [5, 17, 200, 3, 99, 42, 7]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    model, _ = load_model(path, torch.float32, torch.device("cpu"), max_positions=64)
    kv = KVCache.allocate(spec.num_layers, 4, 16, spec.num_kv_heads, spec.head_dim,
                          torch.float32, "cpu")
    seq = ScheduledSequence(request_id="r", token_ids=ids, start_pos=0, block_table=[1],
                            sample=True)
    inputs = build_batch_inputs(ExecuteBatch(step=0, sequences=[seq], num_decodes=0), 16,
                                torch.device("cpu"))
    with torch.inference_mode():
        got = model(inputs.input_ids, inputs.positions, kv, inputs.meta, inputs.logits_indices)
    # The prompt's last position: the row the engine samples from.
    torch.testing.assert_close(got[0], want[-1], rtol=1e-4, atol=1e-4)


def test_same_seed_same_bytes_and_another_seed_differs(tmp_path):
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        write_checkpoint(TINY, tmp_path / name, torch.bfloat16, seed=seed)
    raw = {n: (tmp_path / n / "model.safetensors").read_bytes() for n in "abc"}
    assert raw["a"] == raw["b"] != raw["c"]
    from safetensors.torch import load_file
    state = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in state            # tied: the loader reuses the embedding
    emb = state["model.embed_tokens.weight"].float()
    assert 0.015 < emb.std().item() < 0.025 and torch.isfinite(emb).all()


@pytest.mark.parametrize("spec", [TINY, SMALL_LLAMA3], ids=["tiny", "llama3"])
def test_every_id_decodes_and_words_encode(tmp_path, spec):
    from transformers import AutoTokenizer

    from tokenloom.actors.front.tokenizer_actor import TokenizerActor
    from tokenloom.actors.messages import GenerateRequest
    from tokenloom.actors.output.detokenizer import IncrementalDetokenizer
    from tokenloom.actors.sampling_params import SamplingParams

    write_checkpoint(spec, tmp_path / "m", torch.float32, seed=0)
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert len(tok) == spec.vocab_size
    assert tok.bos_token_id == spec.bos_token_id and tok.eos_token_id == spec.eos_token_ids[0]
    names = token_names(spec)
    every = list(range(spec.vocab_size))
    assert tok.convert_ids_to_tokens(every) == names
    assert tok.decode([3, 4, 9], skip_special_tokens=True) == "t3 t4 t9"
    # Random weights sample anything: one pass over every id, specials included.
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[3, 4])
    text = "".join(detok.add([i]) for i in every) + detok.finish()
    # (the space before the first word separates it from the prompt's last word)
    assert text == " " + tok.decode(every, skip_special_tokens=True)
    assert "t12" in text and "<s>" not in text
    actor = TokenizerActor(tok, max_model_len=spec.max_position_embeddings, emit=lambda o: None,
                           next_inbox=None)
    req = GenerateRequest(request_id="r", prompt="t5 t6 t77",
                          sampling_params=SamplingParams(max_tokens=4))
    assert actor.encode(req)[-3:] == [5, 6, 77]
