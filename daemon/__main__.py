"""The `tokenloom` command line.

    tokenloom generate "prompt" [--chat] [--max-tokens N] [--temperature T] [--set key=value]
    tokenloom serve [--host H] [--port P] [--config PATH] [--model M] [--set key=value]
    tokenloom admin [--socket PATH] [--json] stats|flush-cache|drain|resume|cancel|trace|log-level
    tokenloom replay CAPTURE --url URL [--speed X] [--out FILE] [--plain]
    tokenloom diagnose BEFORE AFTER [--json] [--html FILE] [--model M]
    tokenloom debug prefix-diff A.json B.json

A bad config file, key or value exits with status 2 and a message naming the key; so does
`serve` on an address it cannot bind (a port in use), before it loads the model.
"""

from __future__ import annotations

import argparse
import sys

from tokenloom.config.schema import ConfigError


def _parse_set(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("--set expects key=value (e.g. scheduler.max_num_seqs=8), "
                              f"got {item!r}")
        out[key.strip()] = _scalar(value.strip())
    return out


def _scalar(raw: str):
    import tomllib
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (see config/default.toml)")
    p.add_argument("--model", help="'default' (SmolLM2-135M-Instruct) or a local HF directory")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set scheduler.max_num_seqs=8")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenloom", description="LLM inference serving daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--system", help="system message (with --chat)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    _common(g)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    s.add_argument("--host", help="address to bind (default: server.host, 127.0.0.1)")
    s.add_argument("--port", type=int, help="TCP port (default: server.port, 8000; 0 = any free)")
    s.add_argument("--workers", type=int, metavar="N",
                   help="engine worker processes (default: workers.count, 1 = in-process)")
    s.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=[],
                   help="LoRA adapters (PEFT directories) a request names in `model`")
    s.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (also implied by --lora-modules)")
    s.add_argument("--embeddings", action="store_true",
                   help="serve POST /v1/embeddings with the model (server.embeddings)")
    s.add_argument("--reasoning-parser", metavar="NAME",
                   help="split thinking from answers: auto, none, think, qwen3, deepseek_r1 "
                        "(default: server.reasoning_parser, auto)")
    _common(s)
    from tokenloom.daemon.admin import cli as admin_cli
    admin_cli.add_parser(sub)
    d = sub.add_parser("debug", help="diagnostics")
    dsub = d.add_subparsers(dest="debug_command", required=True)
    pd = dsub.add_parser("prefix-diff", help="where two request bodies' token sequences first "
                         "diverge (why the second misses the prefix cache)")
    pd.add_argument("a", help="request body JSON (completions or chat)")
    pd.add_argument("b", help="request body JSON (completions or chat)")
    _common(pd)
    r = sub.add_parser("replay", help="send a capture's requests at their recorded offsets "
                       "(open loop) and write every response's usage, timings and trace")
    r.add_argument("capture", help="a capture (tokenloom admin record) or replay output")
    r.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    r.add_argument("--speed", type=float, default=1.0,
                   help="arrival-rate multiplier (2 = twice as fast)")
    r.add_argument("--out", help="output JSONL (default: CAPTURE.replay.jsonl)")
    r.add_argument("--plain", action="store_true", help="any OpenAI-compatible server: send "
                   "no tokenloom extensions (no traces come back)")
    r.add_argument("--model", dest="served_model",
                   help="model name to send (default: the server's first /v1/models entry)")
    r.add_argument("--vocab", type=int, default=32000,
                   help="token ids below this for a hashes-only capture's synthetic prompts")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    dg = sub.add_parser("diagnose", help="compare two replays (or captures): the before/after "
                        "table, the ranked mechanisms and the incident sentence")
    dg.add_argument("before")
    dg.add_argument("after")
    dg.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    dg.add_argument("--html", metavar="FILE", help="also write an HTML report with plots")
    dg.add_argument("--model", help="tokenizer for the prefix diff's text ('default' or a "
                    "model directory); without it the diff shows token ids")
    dg.add_argument("--cache-dir", default="", help="model cache directory (with --model)")
    return parser


def cmd_serve(args) -> int:
    from tokenloom.config.load import load_config
    from tokenloom.daemon import logs

    overrides = _parse_set(args.set)
    if args.model:
        overrides["model.model"] = args.model
    if args.host is not None:
        overrides["server.host"] = args.host
    if args.port is not None:
        overrides["server.port"] = args.port
    if args.workers is not None:
        overrides["workers.count"] = args.workers
    if args.enable_lora:
        overrides["lora.enable"] = True
    if args.embeddings:
        overrides["server.embeddings"] = True
    if args.reasoning_parser is not None:
        overrides["server.reasoning_parser"] = args.reasoning_parser
    if args.lora_modules:
        modules = {}
        for item in args.lora_modules:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                print(f"tokenloom: --lora-modules wants NAME=PATH, got {item!r}", file=sys.stderr)
                return 2
            modules[name] = path
        overrides["lora.modules"] = modules
    config = load_config(args.config, overrides=overrides)  # ConfigError: exit 2, before loading
    from tokenloom.daemon.connections import bind_problem
    problem = bind_problem(config.server.host, config.server.port)
    if problem is not None:                                    # exit 2, before loading too
        print(f"tokenloom: {problem}", file=sys.stderr)
        return 2
    logs.configure(config.server.log_level)
    from tokenloom.daemon import lifecycle
    return lifecycle.run(config, config.server.host, config.server.port)


def cmd_generate(args) -> int:
    from tokenloom.actors.llm import LLM
    from tokenloom.actors.sampling_params import SamplingParams
    from tokenloom.config.load import load_config

    overrides = _parse_set(args.set)
    if args.model:
        overrides["model.model"] = args.model
    config = load_config(args.config, overrides=overrides)
    from tokenloom.daemon import logs
    logs.configure("warning")  # stdout carries only the generated text
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    with logs.startup_sink(lambda message: print(message, file=sys.stderr, flush=True)):
        llm = LLM(config=config)  # start-up progress: plain lines on stderr
    try:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            stream = llm.stream(messages=messages, sampling_params=params)
        else:
            stream = llm.stream(args.prompt, sampling_params=params)
        for delta in stream:
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        llm.close()
    return 0


def cmd_prefix_diff(args) -> int:
    from transformers import AutoTokenizer

    from tokenloom.config.load import load_config
    from tokenloom.config.schema import resolve_cache_dir
    from tokenloom.daemon.debug.prefix_diff import run
    from tokenloom.kernels.models.loader import resolve_model_dir

    overrides = _parse_set(args.set)
    if args.model:
        overrides["model.model"] = args.model
    config = load_config(args.config, overrides=overrides)
    model_dir = resolve_model_dir(config.model.model, resolve_cache_dir(config))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    print(run(tokenizer, args.a, args.b, config.cache.block_size))
    return 0


def cmd_replay(args) -> int:
    import asyncio

    from tokenloom.daemon.debug import replay

    out = args.out or f"{args.capture}.replay.jsonl"
    results = asyncio.run(replay.run(args.capture, args.url, out, speed=args.speed,
                                     plain=args.plain, model=args.served_model,
                                     vocab=args.vocab, timeout=args.timeout))
    failed = sum(1 for r in results if r["status"] != 200 or r.get("error"))
    print(f"replayed {len(results)} requests ({failed} failed) -> {out}")
    return 0


def cmd_diagnose(args) -> int:
    import json

    from tokenloom.daemon.debug import report
    from tokenloom.daemon.debug.diagnose import diagnose_files

    diag = diagnose_files(args.before, args.after)
    tokenizer = None
    if args.model:
        from transformers import AutoTokenizer

        from tokenloom.config.schema import ModelConfig, resolve_cache_dir
        from tokenloom.kernels.models.loader import resolve_model_dir
        cache = resolve_cache_dir(ModelConfig(model=args.model, cache_dir=args.cache_dir))
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model, cache))
    if args.html:
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(report.html(diag, tokenizer))
    if args.json:
        print(json.dumps(report.as_json(diag), indent=1))
    else:
        print(report.text(diag, tokenizer))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "admin":
            from tokenloom.daemon.admin import cli as admin_cli
            return admin_cli.run(args)
        if args.command == "debug" and args.debug_command == "prefix-diff":
            return cmd_prefix_diff(args)
        if args.command == "replay":
            return cmd_replay(args)
        if args.command == "diagnose":
            return cmd_diagnose(args)
    except (ConfigError, ValueError) as e:
        print(f"tokenloom: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
