"""HTTP load generator for `tokenloom serve`: TTFT, inter-token latency, end-to-end latency
(p50/p90/p99) and output tokens/s, printed as a table and recorded.

Workload: `--num-requests` streaming /v1/completions requests whose prompts are random token
ids of `--prompt-len` tokens, each generating exactly `--output-len` tokens (ignore_eos),
sent either at a fixed concurrency (`--concurrency N`) or as Poisson arrivals
(`--rate R` requests/s).

Server: `--url` benchmarks a running server; otherwise one is started as a subprocess
(`tokenloom serve --port 0`) with `--model` (default: the bundled model) or, with `--tiny`,
a tiny random-weight Llama with the default model's vocabulary, so that compute is negligible
and the number measures serving overhead (HTTP, SSE, actors, detokenization).
`--offline` also runs the same requests through the offline engine (`LLM.generate`) in this
process, after the server has stopped, and reports the HTTP/offline throughput ratio.
`--transformers` then runs the same workload against `transformers serve
--continuous-batching` (needs `pip install "transformers[serving]"`), one server after the
other, and reports the tokenloom/transformers throughput ratio. That server knows neither
token-id prompts nor ignore_eos, so in this mode both servers get the same text prompts
(random token ids decoded), and output tokens are counted as streamed.

Each run mode writes its record (benchmarks/records.py: serve, serve_shared_prefix or
interference) and its whole summary to benchmarks/raw/.

    python benchmarks/serve.py --tiny --concurrency 64 --num-requests 256 --output-len 64
    python benchmarks/serve.py --concurrency 16 --prompt-len 256 --output-len 64 --offline
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from harness import (
    SUMMARY_COLUMNS,
    build_tiny_vocab_model,
    model_name,
    print_table,
    resolve_dir,
    run_async,
    run_load,
    start_tokenloom,
    start_transformers,
    summarise,
    summary_row,
    text_prompts,
)
from records import record_run, write_raw


def run_offline(model: str, prompts, output_len: int, settings: list[str],
                concurrency: int) -> dict:
    """The same requests through LLM.generate, all submitted at once but with at most
    `concurrency` running (max_num_seqs), like the HTTP run's closed loop."""
    from tokenloom import LLM, SamplingParams

    options = {"scheduler.max_num_seqs": concurrency}
    for item in settings:
        key, _, value = item.partition("=")
        options[key] = json.loads(value) if value[:1].isdigit() else value.strip('"')
    llm = LLM(model=model, quiet=True, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
    finally:
        llm.close()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="benchmark this running server instead of starting one")
    p.add_argument("--model", default="default")
    p.add_argument("--tiny", action="store_true",
                   help="serve a tiny random Llama with the default vocabulary")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for the started server (and --offline)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offline", action="store_true", help="also run the offline engine")
    p.add_argument("--transformers", action="store_true",
                   help="also run `transformers serve --continuous-batching`")
    p.add_argument("--shared-prefix", action="store_true",
                   help="prefix-cache workload: groups of requests sharing a long prefix, run "
                        "with caching on and then off (defaults below unless given)")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--interference", action="store_true",
                   help="long-prompt interference workload, static vs SLO chunking "
                        "(see benchmarks/interference.py)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--long-len", type=int, default=2000)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--long-every", type=float, default=4.0, help="seconds between long prompts")
    args = p.parse_args()
    if args.shared_prefix:
        return shared_prefix_main(args)
    if args.interference:
        return interference(args)

    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    model = args.model
    tmp = None
    if args.tiny:
        from tokenloom.config.schema import ModelConfig, resolve_cache_dir
        from tokenloom.kernels.models.loader import resolve_model_dir

        tmp = tempfile.TemporaryDirectory()
        default_dir = resolve_model_dir("default", resolve_cache_dir(ModelConfig()))
        build_tiny_vocab_model(Path(tmp.name), default_dir)
        model = tmp.name
    server = None
    url = args.url
    if url is None:
        server = start_tokenloom(model, args.set)
        url = server.url
    try:
        name = run_async(model_name(url))
        rng = random.Random(args.seed)
        # Ids from the middle of the vocabulary: ordinary tokens, no special ones.
        prompts = [[rng.randrange(1000, 20000) for _ in range(args.prompt_len)]
                   for _ in range(args.num_requests)]
        if args.transformers:
            prompts = text_prompts(url, prompts)
        run_async(run_load(url, name, prompts[:2], 2, 2, 0, args.seed))  # warm-up
        results, elapsed = run_async(run_load(url, name, prompts, args.output_len,
                                                args.concurrency, args.rate, args.seed))
    finally:
        if server is not None:
            server.stop()
    summary = {"workload": {k: getattr(args, k) for k in (
        "concurrency", "rate", "num_requests", "prompt_len", "output_len", "tiny")},
        "model": name, "http": summarise(results, elapsed)}
    print_table("HTTP (tokenloom serve)", summary["http"])
    if args.offline:
        settings = [s for s in args.set if not s.startswith("server.")]
        summary["offline"] = run_offline(model, prompts, args.output_len, settings,
                                         args.concurrency)
        ratio = summary["http"]["output_tokens_per_s"] / summary["offline"]["output_tokens_per_s"]
        summary["http_over_offline"] = ratio
        print(f"\noffline LLM.generate: {summary['offline']['output_tokens_per_s']:.0f} output "
              f"tok/s; HTTP/offline = {ratio:.3f}")
    write_raw("serve", summary)
    if args.transformers:
        peer = start_transformers(resolve_dir(model))
        turl = peer.url
        try:
            tname = run_async(model_name(turl))
            run_async(run_load(turl, tname, prompts[:2], 2, 2, 0, args.seed, False))
            tresults, telapsed = run_async(run_load(turl, tname, prompts, args.output_len,
                                                      args.concurrency, args.rate, args.seed,
                                                      False))
        finally:
            peer.stop()
        summary["transformers"] = summarise(tresults, telapsed)
        print_table("transformers serve --continuous-batching", summary["transformers"])
        ratio = (summary["http"]["output_tokens_per_s"]
                 / summary["transformers"]["output_tokens_per_s"])
        summary["tokenloom_over_transformers"] = ratio
        print(f"\ntokenloom / transformers output tok/s = {ratio:.2f}")
        write_raw("serve", summary)
    if tmp is not None:
        tmp.cleanup()
    rows = [summary_row("tokenloom serve", summary["http"])]
    if "offline" in summary:
        rows.append(["offline LLM.generate", summary["offline"]["output_tokens_per_s"],
                     *[None] * (len(SUMMARY_COLUMNS) - 2)])
    if "transformers" in summary:
        rows.append(summary_row("transformers serve", summary["transformers"]))
    headline = {"output_tok_s": summary["http"]["output_tokens_per_s"],
                **{k: summary[k] for k in ("http_over_offline", "tokenloom_over_transformers")
                   if k in summary}}
    record_run("serve", headline, {"columns": SUMMARY_COLUMNS, "rows": rows}, args)


def interference(args) -> None:
    from interference import interference_main

    if args.output_len == 64:   # the workload unless given
        args.output_len = 256
    if args.prompt_len == 256:
        args.prompt_len = 64
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    model, tmp = args.model, None
    if args.tiny:
        from tokenloom.config.schema import ModelConfig, resolve_cache_dir
        from tokenloom.kernels.models.loader import resolve_model_dir

        tmp = tempfile.TemporaryDirectory()
        build_tiny_vocab_model(Path(tmp.name), resolve_model_dir(
            "default", resolve_cache_dir(ModelConfig())))
        model = tmp.name
    try:
        interference_main(args, model)
    finally:
        if tmp is not None:
            tmp.cleanup()


def shared_prefix_main(args) -> None:
    """Issue 4's workload: `groups` long shared prefixes, distinct short suffixes; the same
    requests against a server with prefix caching on, then off."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(1000, 20000) for _ in range(args.prefix_len)]
                for _ in range(args.groups)]
    prompts = [prefixes[i % args.groups] + [rng.randrange(1000, 20000)
                                           for _ in range(args.suffix_len)]
               for i in range(args.num_requests)]
    warm = [[rng.randrange(1000, 20000) for _ in range(8)] for _ in range(2)]
    summary = {"workload": {k: getattr(args, k) for k in (
        "concurrency", "num_requests", "groups", "prefix_len", "suffix_len", "output_len")}}
    base_set = list(args.set)
    for label, caching in (("caching_on", "true"), ("caching_off", "false")):
        args.set = base_set + [f"cache.enable_prefix_caching={caching}"]
        server = start_tokenloom(args.model, args.set)
        url = server.url
        try:
            name = run_async(model_name(url))
            run_async(run_load(url, name, warm, 2, 2, 0, args.seed))
            results, elapsed = run_async(run_load(url, name, prompts, args.output_len,
                                                    args.concurrency, 0, args.seed))
        finally:
            server.stop()
        summary[label] = summarise(results, elapsed)
        print_table(f"prefix caching {caching}", summary[label])
    on, off = summary["caching_on"], summary["caching_off"]
    hit, miss = on["ttft_hit_ms"], on["ttft_miss_ms"]
    summary["hit_over_miss_ttft_p50"] = ((hit["p50"] / miss["p50"])
                                         if hit["p50"] and miss["p50"] else None)
    summary["hit_over_cache_off_ttft_p50"] = ((hit["p50"] / off["ttft_ms"]["p50"])
                                              if hit["p50"] else None)
    summary["throughput_on_over_off"] = on["output_tokens_per_s"] / off["output_tokens_per_s"]
    print(f"\nTTFT p50: hits {hit['p50']:.0f} ms (n={hit['n']}), misses {miss['p50']:.0f} ms "
          f"(n={miss['n']}), caching off {off['ttft_ms']['p50']:.0f} ms")
    print(f"hit/miss TTFT p50 = {summary['hit_over_miss_ttft_p50']:.3f}; hit/caching-off = "
          f"{summary['hit_over_cache_off_ttft_p50']:.3f}; throughput on/off = "
          f"{summary['throughput_on_over_off']:.2f}x")
    write_raw("serve_shared_prefix", summary)
    rows = [summary_row("prefix caching on", on), summary_row("prefix caching off", off)]
    headline = {k: summary[k] for k in ("hit_over_miss_ttft_p50", "hit_over_cache_off_ttft_p50",
                                        "throughput_on_over_off")}
    record_run("serve_shared_prefix", headline, {"columns": SUMMARY_COLUMNS, "rows": rows}, args)


if __name__ == "__main__":
    main()
