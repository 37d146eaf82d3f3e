"""Each model family's CPU decode step and prefill chunk against Llama's, at the same shape.

One random-weight checkpoint per family in the registry, all with the same sizes (12 layers,
hidden 576, 9 query heads and 3 KV heads of 64, MLP 1,536: SmolLM2-135M's layer shape,
with a small vocabulary so the layers dominate), so every family streams the same weight
bytes; each family keeps what makes it itself (Qwen3's q/k norms, Gemma's four norms, GeGLU
and soft-capping, sliding windows of 512 tokens where the family has them, Phi-3's fused
checkpoint tensors and partial rotary), and Llama once more with the C++ decode stack
refused (`llama-module`: the module forward the stack's missing options fall back to).
Each model is loaded by the offline engine exactly as it serves (kernels chosen at
start-up, the C++ decode stack where the family's options allow it), one decode step at
~1,100 tokens of context and one 512-token prefill chunk after 512 tokens are captured from
a real request, and the engine is closed. Then, in interleaved
rounds on this thread, each family's step is timed; the summary is each family's time over
Llama's from the same rounds (medians; the spread max/min beside each).

    python benchmarks/family_step.py              # every family, 7 rounds
    python benchmarks/family_step.py --quick      # 2 rounds, fewer layers
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from harness import ms_per_call, tests_module
from records import record_run, write_raw

SHAPE = dict(num_hidden_layers=12, hidden_size=576, intermediate_size=1536,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64,
             max_position_embeddings=4096, initializer_range=0.05)
WINDOW = 512
SLIDING, FULL = "sliding_attention", "full_attention"
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=False)),
    "qwen3": ("Qwen3Config", {}),
    "gemma2": ("Gemma2Config", dict(query_pre_attn_scalar=64, sliding_window=WINDOW,
                                    attn_logit_softcapping=50.0,
                                    final_logit_softcapping=30.0)),
    "gemma3": ("Gemma3TextConfig", dict(query_pre_attn_scalar=64, sliding_window=WINDOW,
                                        layer_types=([SLIDING] * 5 + [FULL]) * 2)),
    "phi3": ("Phi3Config", dict(pad_token_id=0, partial_rotary_factor=0.75)),
    # Llama on the module forward (the C++ decode stack refused): what the families the
    # stack does not implement pay for that alone.
    "llama-module": ("LlamaConfig", {}),
}
NO_STACK = {"llama-module"}
CONTEXT, CHUNK = 1100, 512


def capture(path: Path, cache_dir: str, stack: bool = True) -> tuple[object, tuple, tuple, str]:
    """The engine's model, one decode step's and one prefill chunk's inputs, and whether
    the C++ decode stack serves the family (`stack` False: refused, as for a family whose
    options it does not implement)."""
    from tokenloom import LLM, SamplingParams
    from tokenloom.kernels.cpu import decode_stack
    from tokenloom.kernels.models import decoder

    captured: dict = {}
    original = decoder.CausalLM.forward_hidden

    def spy(self, input_ids, positions, kv, meta):
        kind = "prefill" if meta.prefills else "decode"
        if kind == "decode" and input_ids.shape[0] == 1 or \
                kind == "prefill" and input_ids.shape[0] == CHUNK:
            captured["model"] = self
            captured[kind] = (input_ids.clone(), positions.clone(), kv, meta)
        return original(self, input_ids, positions, kv, meta)

    decoder.CausalLM.forward_hidden = spy
    install = decode_stack.install
    if not stack:
        decode_stack.install = lambda model: False
    try:
        llm = LLM(model=str(path), device="cpu", dtype="float32", quiet=True,
                  cache_dir=cache_dir, enable_prefix_caching=False, chunking="static",
                  max_num_batched_tokens=CHUNK)
        try:
            sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            llm.generate([[3 + (i * 31) % 250 for i in range(CONTEXT - 4)]], sp)
        finally:
            llm.close()
    finally:
        decoder.CausalLM.forward_hidden = original
        decode_stack.install = install
    model = captured["model"]
    stack = "on" if model.decode_stacks is not None else "off"
    return model, captured["decode"], captured["prefill"], stack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    shape = dict(SHAPE)
    if args.quick:
        args.rounds, shape["num_hidden_layers"] = 2, 6
    if "llama" not in args.families:
        args.families.insert(0, "llama")
    tiny = tests_module("tinymodel")
    torch.set_grad_enabled(False)
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families:
            cls, extra = FAMILIES[name]
            extra = dict(extra)
            if "layer_types" in extra and args.quick:
                extra["layer_types"] = extra["layer_types"][:shape["num_hidden_layers"]]
            path = Path(tmp) / name
            tiny.build_tiny_model(path, cls, {**shape, **extra}, seed=1)
            models[name] = capture(path, tmp, stack=name not in NO_STACK)
            print(f"{name}: captured (C++ decode stack {models[name][3]})", flush=True)
    head = torch.tensor([0])
    runs = {name: {"decode": [], "prefill": []} for name in models}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, (model, dec, pre, _) in models.items():
                runs[name]["decode"].append(ms_per_call(
                    lambda: model.logits(model.forward_hidden(*dec), head), 10))
                runs[name]["prefill"].append(ms_per_call(lambda: model.forward_hidden(*pre), 2))
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in runs.items()}
    spread = {n: {k: max(v) / min(v) for k, v in r.items()} for n, r in runs.items()}
    base = med["llama"]
    rows, summary = [], {}
    print(f"\n{'family':<10}{'stack':>7}{'decode ms':>11}{'x llama':>9}{'prefill ms':>12}"
          f"{'x llama':>9}")
    for name, (_, _, _, stack) in models.items():
        d, p = med[name]["decode"], med[name]["prefill"]
        rd, rp = d / base["decode"], p / base["prefill"]
        summary[f"{name}_decode_vs_llama"] = rd
        summary[f"{name}_prefill_vs_llama"] = rp
        rows.append([name, stack, d, spread[name]["decode"], rd, p, spread[name]["prefill"], rp])
        print(f"{name:<10}{stack:>7}{d:>11.2f}{rd:>9.2f}{p:>12.1f}{rp:>9.2f}")
    columns = ["family", "C++ decode stack", "decode step ms", "spread", "decode x llama",
               f"prefill {CHUNK} ms", "spread", "prefill x llama"]
    write_raw("family_step", {"runs": runs})
    record_run("family_step", summary, {"columns": columns, "rows": rows}, args,
               smoke=args.quick)


if __name__ == "__main__":
    main()
