"""Every family in the registry against `transformers` on tiny random checkpoints.

Each variant is a tiny model built from transformers' own config class (fp32, eager
attention, random weights scaled so logits are not near-uniform; norms and biases perturbed
so a swapped tensor shows), with a sliding window shorter than the prompts where the family
has one and mixed layer types. Checked:
1. greedy tokens equal transformers' `generate` — a divergence counts only where the
   reference's top-2 logit gap exceeds 1e-3 (a near-tie may flip on summation order) — one
   prompt at a time, all at once, and under the wide matrix's schedules (chunks that
   straddle the window's edge, prefix hits at and across it, preemption by swap and by
   recompute, n-gram speculation, CPU compiled decode programs);
2. prompt logprobs within 1e-4 of transformers' log-softmax, chunked;
3. the registry refuses what it cannot run, naming it.

The default run takes a few cases per family; `make test-families` (pytest -m families) runs
the wide matrix.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.actors.kv.groups import KVGroups
from tokenloom.arith import cdiv
from tokenloom.kernels.models.loader import load_spec
from tokenloom.kernels.models.model_spec import UnsupportedModelError
from tokenloom.kernels.models.registry import supported_architectures

from tinymodel import VOCAB, Variant, build_tiny_model, build_variant

MAX_TOKENS = 12
BLOCK_SIZE = 8
WINDOW = 24     # shorter than most prompts: every sliding layer drops keys
GAP = 1e-3      # a reference top-2 gap below this is a near-tie


SLIDING, FULL = "sliding_attention", "full_attention"
VARIANTS = {
    # Qwen3: q/k norms, an explicit head_dim unlike hidden / heads, tied head.
    "qwen3": Variant("Qwen3Config", dict(num_hidden_layers=2, head_dim=32,
                                         tie_word_embeddings=True), (70, 9, 40), seed=11),
    # Qwen3 with its second layer on a sliding window (use_sliding_window, max_window_layers).
    "qwen3-window": Variant("Qwen3Config", dict(
        num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1), (66, 13, 35), seed=12),
    # Qwen2 with a sliding window on layers >= max_window_layers, q/k/v biases.
    "qwen2-window": Variant("Qwen2Config", dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1, tie_word_embeddings=True), (61, 10, 37), seed=13),
    # Mistral v0.1 style: every layer on the window.
    "mistral-window": Variant("MistralConfig", dict(
        num_hidden_layers=2, sliding_window=WINDOW, head_dim=16), (58, 7, 30), seed=14),
    # Gemma 2: soft-capped scores and logits (caps small enough to bite), sliding layers
    # alternating with full ones, query_pre_attn_scalar unlike head_dim.
    "gemma2": Variant("Gemma2Config", dict(
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        attn_logit_softcapping=5.0, final_logit_softcapping=15.0, initializer_range=0.1),
        (64, 8, 33), seed=15),
    # Gemma 3: q/k norms, 3 local : 1 global, the local layers' own RoPE base, and a linear
    # scaling on the global one.
    "gemma3": Variant("Gemma3TextConfig", dict(
        num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=[SLIDING, SLIDING, SLIDING, FULL], initializer_range=0.1,
        rope_parameters={FULL: {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
                         SLIDING: {"rope_type": "default", "rope_theta": 1e4}}),
        (67, 11, 29), seed=16),
    # Phi-3: fused checkpoint tensors, partial rotary, LongRoPE whose original window (48)
    # the longest prompt passes (its tokens then rotate with the long factors) and the
    # second grows past while it decodes (recomputed under the long factors, as
    # transformers does).
    "phi3": Variant("Phi3Config", dict(
        num_hidden_layers=2, pad_token_id=0, original_max_position_embeddings=48,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                         "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.1, 1.3, 1.6],
                         "long_factor": [1.0, 2.0, 4.0, 8.0]}), (60, 41, 9), seed=17),
    # Llama with YaRN scaling over a short original context.
    "llama-yarn": Variant("LlamaConfig", dict(
        num_hidden_layers=2, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 32}),
        (70, 12, 33), seed=18),
}


@dataclasses.dataclass
class Family:
    name: str
    path: Path
    hf: torch.nn.Module
    prompts: list[list[int]]
    _reference: list[tuple[list[int], list[float]]] | None = None

    def reference(self) -> list[tuple[list[int], list[float]]]:
        """transformers' greedy continuation of each prompt, with the top-2 logit gap at
        each generated position (computed once)."""
        if self._reference is None:
            self._reference = [greedy_with_gaps(self.hf, p, MAX_TOKENS) for p in self.prompts]
        return self._reference


@torch.inference_mode()
def greedy_with_gaps(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                      eos_token_id=None, pad_token_id=0, output_logits=True,
                      return_dict_in_generate=True,
                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for logits in out.logits:
        top = logits[0].float().topk(2).values
        gaps.append(float(top[0] - top[1]))
    assert len(tokens) == n, "the oracle stopped early"
    return tokens, gaps


def assert_greedy_matches(got: list[int], tokens: list[int], gaps: list[float], what: str):
    """Equal up to the first position where the reference itself is a near-tie."""
    for i, (g, e) in enumerate(zip(got, tokens)):
        if g != e:
            assert gaps[i] < GAP, (f"{what}: token {i} is {g}, transformers gives {e} with a "
                                   f"top-2 gap of {gaps[i]:.2e}")
            return
    assert len(got) == len(tokens), f"{what}: {len(got)} tokens, expected {len(tokens)}"


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    """Factory: family(name) -> Family, built and saved once per session."""

    built: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            built[name] = Family(name, path, *build_variant(path, VARIANTS[name],
                                                            attn_implementation="eager"))
        return built[name]

    return get


def make_llm(m: Family, tmp_path: Path, **options) -> LLM:
    return LLM(model=str(m.path), quiet=True, dtype="float32", device="cpu",
               cache_dir=str(tmp_path), block_size=BLOCK_SIZE, **options)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _tight_pool(m: Family) -> int:
    """Room for the longest request alone at its peak (its prompt in one chunk: a block a
    position in every layer group; or at its end, sliding groups holding their windows
    only), plus the reserved NULL_BLOCK of a sliding layout: far less than all of them."""
    spec = load_spec(m.path)
    groups = KVGroups.plan([spec.window(i) for i in range(spec.num_layers)])
    prompt = max(len(p) for p in m.prompts)
    end = prompt + MAX_TOKENS
    peak = max(groups.num_groups * cdiv(prompt, BLOCK_SIZE),
               groups.blocks_for(end, end - 1, BLOCK_SIZE))
    return peak + 1 + groups.hybrid


def _prefix_prompts(m: Family) -> list[list[int]]:
    """The prompts, then continuations of the first that share its first 32 and 40 tokens
    (a hit at and past the window's edge) and all of it (the whole prompt cached)."""
    p = m.prompts[0]
    rng = random.Random(len(p))
    return [*m.prompts, p[:32] + [rng.randrange(3, VOCAB) for _ in range(9)],
            p[:40] + [rng.randrange(3, VOCAB) for _ in range(5)], p + [5, 6, 7]]


SCHEDULES = {
    "one-at-a-time": dict(),
    "all-at-once": dict(),
    # Chunks of 16 tokens: they straddle the 24-token window's edge.
    "chunked": dict(max_num_batched_tokens=16, max_num_seqs=4),
    "prefix-hits": dict(enable_prefix_caching=True, max_num_batched_tokens=16, max_num_seqs=4),
    "preempt": "tight",
    "preempt-swap": "tight-swap",
    "ngram": {"speculative.method": "ngram", "speculative.mode": "on",
              "speculative.num_speculative_tokens": 3},
    "compiled": {"graphs.cpu_compile": True, "max_num_seqs": 4},
    # cache.hybrid_kv off: one table keeps every block, so the KV tiers (host tier) and the
    # compiled decode programs run; chunked, with prefix hits across the window's edge.
    "one-table": {"cache.hybrid_kv": False, "graphs.cpu_compile": True, "max_num_seqs": 4,
                  "max_num_batched_tokens": 16, "kv_tiers.enabled": True,
                  "kv_tiers.host_bytes": 1 << 22},
}
DEFAULT_RUN = {"one-at-a-time", "chunked", ("gemma3", "one-table"), ("gemma2", "prefix-hits"),
               ("gemma3", "preempt-swap")}


def _options(m: Family, schedule: str) -> dict:
    opts = SCHEDULES[schedule]
    if isinstance(opts, dict):
        return opts
    tight = dict(num_blocks=_tight_pool(m), max_num_seqs=4, admission_lookahead_tokens=0,
                 kv_watermark=0.0, kv_resume_watermark=0.0)
    if opts == "tight-swap":
        tight.update(preemption_mode="swap", swap_space_bytes=1 << 20)
    return tight


def _cases():
    for name in VARIANTS:
        for schedule in SCHEDULES:
            default = schedule in DEFAULT_RUN or (name, schedule) in DEFAULT_RUN
            marks = [] if default else [pytest.mark.families]
            yield pytest.param(name, schedule, marks=marks, id=f"{name}-{schedule}")


@pytest.mark.parametrize("name,schedule", list(_cases()))
def test_greedy_matches_transformers(family, tmp_path, name, schedule):
    m = family(name)
    hits = schedule in ("prefix-hits", "one-table")
    prompts = _prefix_prompts(m) if hits else m.prompts
    expected = [greedy_with_gaps(m.hf, p, MAX_TOKENS) for p in prompts] if hits \
        else m.reference()
    llm = make_llm(m, tmp_path, **_options(m, schedule))
    try:
        if schedule in ("one-at-a-time", "prefix-hits", "one-table"):
            got = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
        else:
            got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        stats = llm.scheduler_stats()
        llm.check_integrity()
    finally:
        llm.close()
    for i, (g, (tokens, gaps)) in enumerate(zip(got, expected)):
        assert_greedy_matches(g, tokens, gaps, f"{name}/{schedule}: prompt {i} "
                                               f"({len(prompts[i])} tokens)")
    if schedule.startswith("preempt"):
        # The tight pool preempts, or (sliding layers) it held the requests together only
        # because their sliding groups dropped the blocks behind their windows.
        spec = load_spec(m.path)
        groups = KVGroups.plan([spec.window(i) for i in range(spec.num_layers)])
        undropped = sum(groups.num_groups * cdiv(len(p) + MAX_TOKENS, BLOCK_SIZE)
                        for p in prompts)
        assert stats.num_preemptions > 0 or (
            groups.hybrid and undropped > _tight_pool(m) - groups.hybrid), \
            "the tight pool was meant to force preemption"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prompt_logprobs_match_transformers(family, tmp_path, name):
    """Every prompt position's logprob of its token, chunked across the window's edge."""
    m = family(name)
    prompt = m.prompts[0]
    llm = make_llm(m, tmp_path, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                    prompt_logprobs=0))[0]
    finally:
        llm.close()
    with torch.inference_mode():
        logits = m.hf(torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits, dim=-1)
    for i in range(1, len(prompt)):
        got = out.prompt_logprobs[i][prompt[i]]
        ref = float(want[i - 1, prompt[i]])
        assert abs(got - ref) < 1e-4, f"{name}: prompt position {i}: {got} vs {ref}"


def test_outputs_are_not_degenerate(family):
    """Parity only means something if the models emit varied tokens and differ from one
    another."""
    for name in VARIANTS:
        for tokens, _ in family(name).reference():
            assert len(set(tokens)) >= 3, f"{name} repeats itself: {tokens}"


def test_specs_carry_the_family_options(family):
    qwen3 = load_spec(family("qwen3").path)
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.sliding_window is None
    gemma2 = load_spec(family("gemma2").path)
    assert gemma2.attn_logit_softcap == 5.0 and gemma2.final_logit_softcap == 15.0
    assert gemma2.sandwich_norms and gemma2.norm_offset == 1.0
    assert gemma2.activation == "gelu_tanh" and gemma2.attention_scale == 24 ** -0.5
    assert gemma2.layer_types[:2] == (SLIDING, FULL) and gemma2.sliding_window == WINDOW
    gemma3 = load_spec(family("gemma3").path)
    assert gemma3.rope.theta == 1e6 and gemma3.rope.rope_type == "linear"
    assert gemma3.rope_local.theta == 1e4 and gemma3.qk_norm
    phi3 = load_spec(family("phi3").path)
    assert phi3.rope.rope_type == "longrope" and phi3.rope.rotary_dim == 8
    assert load_spec(family("mistral-window").path).layer_types == (SLIDING, SLIDING)
    for name in ("qwen3", "gemma2", "gemma3", "phi3", "mistral-window", "qwen2-window"):
        assert load_spec(family(name).path).architecture in supported_architectures()


def test_unsupported_architecture_and_rope_are_named(tmp_path):
    import json

    build_tiny_model(tmp_path / "m", "LlamaConfig", dict(num_hidden_layers=1), seed=0)
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["FancyForCausalLM"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="FancyForCausalLM.*Qwen3ForCausalLM"):
        load_spec(tmp_path / "m")
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["rope_parameters"] = {"rope_type": "mrope", "rope_theta": 1e4}
    cfg.pop("rope_scaling", None)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="rope_type 'mrope'"):
        load_spec(tmp_path / "m")


LORA_CASES = [pytest.param("phi3", id="phi3"),
              *(pytest.param(n, id=n, marks=pytest.mark.families) for n in ("gemma3", "qwen3"))]


@pytest.mark.parametrize("name", LORA_CASES)
def test_lora_matches_peft(family, tmp_path, name):
    """A PEFT adapter on the family's own target modules (Phi-3: the stored-fused qkv_proj
    and gate_up_proj) gives PEFT's greedy tokens."""
    from tokenloom.kernels.models.registry import family_for

    from tinymodel import build_random_adapter, peft_oracle

    m = family(name)
    targets = family_for(load_spec(m.path).architecture).lora_targets
    adapter = build_random_adapter(m.path, tmp_path / "adapter", rank=4, seed=3,
                                   targets=targets)
    hf = peft_oracle(m.path, adapter)
    expected = [greedy_with_gaps(hf, p, MAX_TOKENS) for p in m.prompts]
    llm = make_llm(m, tmp_path, **{"lora.modules": {"a": str(adapter)}},
                   max_num_batched_tokens=16, max_num_seqs=4)
    try:
        got = [o.token_ids for o in llm.generate(m.prompts, GREEDY, lora="a")]
        llm.check_integrity()
    finally:
        llm.close()
    assert [t for t, _ in expected] != [t for t, _ in m.reference()], "the adapter is a no-op"
    for i, (g, (tokens, gaps)) in enumerate(zip(got, expected)):
        assert_greedy_matches(g, tokens, gaps, f"{name}+LoRA: prompt {i}")


# mode -> (options, the reference top-2 gap above which the first token must agree; None:
# not checked — 4-bit blocks of 32 over these 64-wide random rows move logits by more than
# a tiny model's gaps, so only serving is checked; the gate's KL is q4's measure).
MODES = {"int8": (dict(weight_dtype="int8"), 0.5), "q8": (dict(weight_dtype="q8"), 0.5),
         "q4": (dict(weight_dtype="q4"), None), "kv-int8": (dict(kv_dtype="int8"), 0.5),
         "kv-fp16": (dict(kv_dtype="fp16"), 0.5), "bf16": (dict(dtype="bfloat16"), 0.5)}


@pytest.mark.parametrize("name", ["gemma3", pytest.param("phi3", marks=pytest.mark.families),
                                  pytest.param("qwen3", marks=pytest.mark.families)])
def test_weight_and_kv_modes_gate_and_serve(family, tmp_path, name):
    """Every CPU weight mode and KV format starts on the family: its quality gate measures
    it against the model-dtype forward (random tiny weights may fail it: then the forced
    mode serves), the first token agrees with transformers wherever the reference's top-2
    gap is wide, and no block leaks."""
    m = family(name)
    for mode, (opts, gap) in MODES.items():
        llm = LLM(model=str(m.path), quiet=True, device="cpu", cache_dir=str(tmp_path),
                  block_size=BLOCK_SIZE, **{"dtype": "float32", "model.force_quantized": True,
                                            "cache.force_kv_dtype": True, **opts})
        try:
            got = [o.token_ids for o in llm.generate(m.prompts, GREEDY)]
            llm.check_integrity()
        finally:
            llm.close()
        for i, (g, (tokens, gaps)) in enumerate(zip(got, m.reference())):
            assert len(g) == MAX_TOKENS
            assert gap is None or g[0] == tokens[0] or gaps[0] < gap, \
                f"{name}/{mode}: prompt {i}'s first token {g[0]}, transformers {tokens[0]}"
