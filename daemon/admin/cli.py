"""`tokenloom admin <command>`: talk to a running daemon's admin socket.

    tokenloom admin stats
    tokenloom admin flush-cache [--force]
    tokenloom admin drain [--timeout S] [--wait]
    tokenloom admin resume
    tokenloom admin cancel ID          # the id the client saw (cmpl-…, chatcmpl-…)
    tokenloom admin trace ID
    tokenloom admin log-level LEVEL
    tokenloom admin record start --out FILE [--content body|tokens|hashes] [--max-bytes N]
    tokenloom admin record stop
Common options: --socket PATH (default: admin.socket_path from --config / the environment /
the defaults, i.e. /run/tokenloom/admin.sock, or where a daemon run by hand falls back to:
$XDG_RUNTIME_DIR/tokenloom/admin.sock, else <tmp>/tokenloom-<uid>/admin.sock),
--json (print the reply as JSON), --timeout-connect S.

Exit status: 0 the command succeeded; 1 the daemon refused or failed it (the reply's error
is printed); 2 bad usage; 3 the daemon could not be reached.
"""

from __future__ import annotations

import json
import socket
import sys

import msgspec

from tokenloom.daemon.admin import protocol as P

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


def add_parser(sub) -> None:
    a = sub.add_parser("admin", help="send an admin command to a running daemon (UNIX socket)")
    a.add_argument("--socket", help="admin socket path (default: admin.socket_path)")
    a.add_argument("--config", help="TOML config file to read admin.socket_path from")
    a.add_argument("--json", action="store_true", help="print the reply as JSON")
    a.add_argument("--reply-timeout", type=float, default=30.0, metavar="S",
                   help="seconds to wait for the reply (default 30; drain --wait: no limit)")
    cmds = a.add_subparsers(dest="admin_command", required=True)
    cmds.add_parser("stats", help="queues, running requests, KV blocks, hit rates, drain state")
    cmds.add_parser("graph-histogram", help="the decode batch sizes seen, as the JSON file "
                                            "graphs.histogram_path reads")
    f = cmds.add_parser("flush-cache", help="drop every unreferenced prefix-cache block")
    f.add_argument("--force", action="store_true", help="even while requests run")
    d = cmds.add_parser("drain", help="stop admitting requests and let running ones finish")
    d.add_argument("--timeout", type=float, metavar="S",
                   help="end the requests still running after S seconds with an error")
    d.add_argument("--wait", action="store_true", help="return once drained")
    cmds.add_parser("resume", help="admit requests again after a drain")
    c = cmds.add_parser("cancel", help="end a running request with an error, freeing its KV")
    c.add_argument("request_id")
    t = cmds.add_parser("trace", help="the per-request trace of a recent request")
    t.add_argument("request_id")
    ll = cmds.add_parser("log-level", help="change the log level at run time")
    ll.add_argument("level", choices=["debug", "info", "warning", "error"])
    r = cmds.add_parser("record", help="record live traffic as a capture for `tokenloom "
                                       "replay` and `tokenloom diagnose`")
    rsub = r.add_subparsers(dest="record_command", required=True)
    rs = rsub.add_parser("start", help="start writing the capture (JSONL)")
    rs.add_argument("--out", required=True, help="capture file (on the daemon's host)")
    rs.add_argument("--content", choices=["body", "tokens", "hashes"], default="body",
                    help="keep request bodies, prompt token ids, or only per-block hashes "
                         "and lengths (no text leaves the host)")
    rs.add_argument("--max-bytes", type=int, help="stop growing past this size "
                                                  "(default: record.max_bytes)")
    rsub.add_parser("stop", help="stop recording; prints what was written")


def build_command(args) -> P.Command:
    match args.admin_command:
        case "stats" | "graph-histogram":
            return P.Stats()
        case "flush-cache":
            return P.FlushCache(force=args.force)
        case "drain":
            return P.Drain(timeout=args.timeout, wait=args.wait)
        case "resume":
            return P.Resume()
        case "cancel":
            return P.Cancel(request_id=args.request_id)
        case "trace":
            return P.Trace(request_id=args.request_id)
        case "log-level":
            return P.SetLogLevel(level=args.level)
        case "record" if args.record_command == "start":
            import os
            return P.RecordStart(path=os.path.abspath(args.out), content=args.content,
                                 max_bytes=args.max_bytes)
        case "record":
            return P.RecordStop()
    raise ValueError(f"unknown admin command {args.admin_command!r}")


def socket_path(args) -> str:
    if args.socket:
        return args.socket
    from tokenloom.config.load import load_config
    from tokenloom.daemon.admin.paths import find_socket
    return find_socket(load_config(args.config).admin.socket_path)


def send(path: str, command: P.Command, timeout: float | None = 30.0) -> P.Reply:
    """One command, one reply. OSError if the socket cannot be reached or answers nothing."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(P.encode(command))
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError("the daemon closed the connection without a reply")
            buf += chunk
    return P.decode_reply(buf)


def render(reply: P.Reply) -> str:
    """Human-readable text for a reply."""
    match reply:
        case P.ErrorReply(code=code, error=error):
            return f"error ({code}): {error}"
        case P.StatsReply():
            return _render_stats(reply)
        case P.FlushCacheReply(freed=freed):
            return f"prefix cache flushed: {freed} block(s) freed"
        case P.DrainReply(progress=p):
            return _render_drain(p)
        case P.ResumeReply(was_draining=was):
            return "resumed: admitting requests" if was else "not draining: nothing to resume"
        case P.CancelReply(request_id=rid, cancelled=ids):
            return f"cancelled {rid} ({len(ids)} engine request(s): {', '.join(ids)})"
        case P.TraceReply(trace=trace):
            return msgspec.json.format(msgspec.json.encode(trace), indent=2).decode()
        case P.LogLevelReply(level=level, previous=previous):
            return f"log level: {previous} -> {level}"
        case P.RecordReply(recording=True, path=path, content=content):
            return f"recording into {path} (content: {content})"
        case P.RecordReply(path=path, requests=n, dropped=dropped, bytes=size):
            return (f"recording stopped: {n} request(s), {size} bytes in {path}"
                    + (f"; {dropped} dropped past max_bytes" if dropped else ""))
    return str(reply)


def _render_drain(p: P.DrainProgress) -> str:
    if not p.draining:
        return "not draining"
    state = "drained" if p.drained else "draining"
    parts = [f"{state}: {p.in_flight} request(s) in flight"]
    if p.elapsed_seconds is not None:
        parts.append(f"{p.elapsed_seconds:.1f} s elapsed")
    if p.timeout_seconds is not None:
        parts.append(f"timeout {p.timeout_seconds:g} s")
    if p.timed_out:
        parts.append("timed out: the rest were ended with an error")
    if p.exiting:
        parts.append("the daemon exits when done")
    return ", ".join(parts)


def _lora_row(lo, loads) -> str:
    resident = [n for n in lo.resident if n]
    row = (f"{len(lo.registered)} served, {len(resident)} / {lo.max_loras} slots held "
           f"({', '.join(resident) or 'none'}); running: {', '.join(lo.running) or 'none'}; "
           f"waiting: {', '.join(lo.waiting) or 'none'}; {lo.num_loads} loads, "
           f"{lo.num_evictions} evictions, {lo.num_slot_waits} slot waits")
    if loads is not None:
        row += (f"; from disk {loads.from_disk} ({1000 * loads.disk_seconds:.0f} ms), "
                f"from host {loads.from_host} ({1000 * loads.host_seconds:.0f} ms)")
    return row


def _kv_quant_row(q) -> str:
    """The KV dtype, its bytes per token and what the runtime quality check saw."""
    text = f"{q.kv_dtype}, {q.bytes_per_token} bytes/token"
    if q.rotation != "none":
        text += f", {q.rotation} rotation"
    if q.check_fraction:
        text += (f"; quality check every {round(1 / q.check_fraction)} decode steps: "
                 f"{q.check_steps} checked, {q.check_alarms} alarms, max attention KL "
                 f"{q.check_max_kl:.4f} nats, max K/V error {q.check_max_error:.3f}")
    if q.promoted_layers:
        text += f"; layers promoted to the model dtype: {q.promoted_layers}"
    return text


def _tier_rows(tiers) -> list[tuple[str, str]]:
    """One row per KV tier (docs/kv-tiers.md): usage, health, hits, traffic. `tiers` is the
    TiersStats, or its plain form when it came over the socket."""
    if tiers is None:
        return []
    get = (lambda o, k: o[k]) if isinstance(tiers, dict) else getattr  # noqa: E731
    rows = [("KV tiers: planner", f"{get(tiers, 'planner')}, {get(tiers, 'restores')} restores "
                                  f"({get(tiers, 'restored_blocks')} blocks)")]
    for t in get(tiers, "tiers"):
        c = get(t, "counters")
        cap = get(t, "bytes_capacity")
        health = f"DEGRADED: {get(t, 'degraded_reason')}" if get(t, "degraded") else "ok"
        rows.append((f"KV tier {get(t, 'name')}", (
            f"{get(t, 'num_blocks')} blocks, {get(t, 'bytes_used') / 2**20:.1f}"
            + (f" / {cap / 2**20:.0f} MiB" if cap else " MiB")
            + f", write {get(t, 'write_policy')}, {health}, hits {get(c, 'hits')} / "
              f"{get(c, 'queries')} blocks, in {get(c, 'bytes_to_device') / 2**20:.1f} MiB, "
              f"out {get(c, 'bytes_from_device') / 2**20:.1f} MiB, "
              f"{get(c, 'dropped_writes')} dropped writes")))
    return rows


def _render_stats(r: P.StatsReply) -> str:
    """A summary of what an operator looks at first, then every field of the engine's
    stats by section (so a new counter shows without touching this file)."""
    e = r.engine
    sched, kv, pc, t = e.scheduler, e.kv, e.kv.prefix_cache, e.scheduler.timings
    rows = [
        ("model", r.model),
        ("ready", "yes" if r.ready else "no"),
        ("drain", _render_drain(r.drain)),
        ("uptime", f"{r.uptime_seconds:.0f} s"),
        ("log level", r.log_level),
        ("HTTP requests in flight", r.in_flight),
        ("engine: running / waiting", f"{sched.running} / {sched.waiting}"),
        ("engine: steps, preemptions", f"{sched.num_steps}, {sched.num_preemptions}"),
        ("engine: stalled", f"{r.engine_stalled_seconds:.1f} s"),
        ("KV blocks: used / free / total", f"{kv.used} / {kv.free} / {kv.num_blocks} "
                                           f"({100 * kv.usage:.1f}% used)"),
        ("KV blocks cached", kv.cached_blocks),
        ("KV storage", _kv_quant_row(e.kv_quant)),
        ("prefix cache hit rate", f"{100 * pc.hit_rate:.1f}% ({pc.hit_tokens} / "
                                  f"{pc.queried_tokens} tokens)"),
        ("hit rate after preemption", f"{100 * pc.preempted_hit_rate:.1f}%"),
        ("admission", "paused (KV resume watermark)" if sched.admission_paused else "open"),
        ("prefill budget", "static" if sched.prefill_budget is None
         else f"{sched.prefill_budget} tokens (SLO)"),
        ("step cost model", "not fitted" if sched.cost_model is None else
         "{:.2f} ms + {:.4f} ms/token + {:.3f} ms/M query-key pairs + {:.3f} ms/M keys "
         "read + {:.4f} ms/sampled row".format(*(1000 * c for c in sched.cost_model),
                                               *(0.0,) * (5 - len(sched.cost_model)))),
        ("goodput", f"{sched.num_slo_good} / {sched.num_slo_evaluated} requests"),
        ("decode graphs", _graphs_row(e.graphs)),
        ("engine loop", ("overlapped" if sched.overlap else "serial") +
         f", step {t.forward_ms:.2f} ms forward + {t.host_ms:.2f} ms "
         f"host ({t.exposed_host_ms:.2f} ms exposed), mean batch {t.batch_size:g}"),
    ]
    if r.process is not None:
        p = r.process
        rows += [
            ("process", f"RSS {p.rss_bytes / 2**20:.0f} MiB, {p.open_fds} fds, "
                        f"{p.asyncio_tasks} tasks, {p.threads} threads"),
            ("HTTP connections", f"{p.connections_open} open, {p.connections_refused} refused "
                                 f"over the cap, {p.header_timeouts} header timeouts, "
                                 f"{p.slow_readers_cut} slow readers cut"),
        ]
    rows += _tier_rows(kv.tiers)
    if sched.lora is not None:
        rows.append(("LoRA adapters", _lora_row(sched.lora, e.lora_loads)))
    for w in r.workers:
        role = "" if w.role == "both" else f"{w.role}, "
        rows.append((f"worker {w.worker}", role + (
            f"up, pid {w.pid}" if w.up else f"DOWN (last exit {w.last_exit_code})")
            + (", draining" if w.draining else "")
            + f", {w.restarts} restarts, {w.in_flight} in flight, {w.routed} routed "
              f"({w.expected_hit_blocks} blocks expected cached), KV {100 * w.kv_usage:.1f}%, "
              f"prefix hit rate {100 * w.prefix_cache_hit_rate:.1f}%"))
    if r.disaggregation is not None:
        rows.append(("disaggregation", _disaggregation_row(r.disaggregation)))
    rows.append(("", ""))
    rows += _struct_rows("engine", e)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}".rstrip() for k, v in rows)


def _disaggregation_row(d: dict) -> str:
    if d.get("mode") == "kv_transfer":   # handoffs between daemons (llm-d's protocol)
        return (f"kv_transfer role {d['role']} on port {d['port']}: {d['exports']} exports, "
                f"{d['blocks_served']} blocks served ({d['bytes_served'] / 1e6:.1f} MB); "
                f"{d['pulls']} pulls ({d['pulls_failed']} failed), {d['blocks_pulled']} "
                f"blocks pulled ({d['bytes_pulled'] / 1e6:.1f} MB), {d['blocks_missing']} "
                f"missing; leases in flight {d['leases']['in_flight']}")
    h = d.get("handoffs") or {}
    decisions = ", ".join(f"{k} {v}" for k, v in sorted(d.get("decisions", {}).items()))
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(h.get("outcomes", {}).items()))
    return (f"mode {d['mode']}; decisions: {decisions or 'none'}; handoffs in flight "
            f"{h.get('in_flight', 0)} ({h.get('leased_blocks', 0)} blocks leased), "
            f"{h.get('bytes_transferred', 0) / 1e6:.1f} MB moved; outcomes: {outcomes or 'none'}; "
            f"prefill ms/token {d.get('prefill_ms_per_token')}, decode ms/token "
            f"{d.get('decode_ms_per_token')}, transfer {d.get('transfer_mb_s')} MB/s, "
            f"prefill duty forecast {d.get('prefill_duty_forecast')}")


def _struct_rows(prefix: str, obj) -> list[tuple[str, object]]:
    """Every field of a stats Struct as `section.field  value`, nested Structs in turn."""
    rows, nested = [], []
    for name in obj.__struct_fields__:
        value = getattr(obj, name)
        if isinstance(value, msgspec.Struct):
            nested.append((f"{prefix}.{name}", value))
        else:
            rows.append((f"{prefix}.{name}", value))
    for sub_prefix, sub in nested:
        rows += _struct_rows(sub_prefix, sub)
    return rows


def _graphs_row(g) -> str:
    """Decode graph, piecewise and eager steps, why eager, padding waste, and the decode
    batch sizes seen (a GraphStats)."""
    if not (g.graph_steps or g.eager_steps or g.piecewise_steps):
        return "no data yet"
    reasons = ", ".join(f"{n} {why}" for why, n in sorted(g.eager_reasons.items()))
    sizes = g.decode_batch_size_histogram
    piecewise = (f"{g.piecewise_steps} piecewise (padding "
                 f"{100 * g.piecewise_padding_waste_fraction:.1f}%), " if g.piecewise else "")
    return (f"{g.graph_steps} graph, {piecewise}{g.eager_steps} eager"
            + (f" ({reasons})" if reasons else "")
            + f"; padding waste {100 * g.padding_waste_fraction:.1f}%"
            + (f"; decode batch sizes {sizes}" if sizes else ""))


def run(args) -> int:
    try:
        command = build_command(args)
    except (ValueError, msgspec.ValidationError) as e:
        print(f"tokenloom admin: {e}", file=sys.stderr)
        return EXIT_USAGE
    path = socket_path(args)
    waits = isinstance(command, P.Drain) and command.wait
    try:
        reply = send(path, command, timeout=None if waits else args.reply_timeout)
    except (OSError, msgspec.DecodeError) as e:
        print(f"tokenloom admin: cannot talk to the daemon at {path}: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.admin_command == "graph-histogram" and isinstance(reply, P.StatsReply):
        # {batch_size: count}: save it and point graphs.histogram_path at the file.
        print(json.dumps(reply.engine.graphs.decode_batch_size_histogram))
    elif args.json:
        print(msgspec.json.encode(reply).decode())
    else:
        print(render(reply), file=sys.stdout if reply.ok else sys.stderr)
    return EXIT_OK if reply.ok else EXIT_REFUSED
