"""The admin channel's pure parts, without a daemon: the wire format (tagged msgspec commands
and typed replies), the peer allow-list, the CLI's rendering, the in-flight registry and the
run-time log level."""

from __future__ import annotations

import logging

import msgspec
import pytest

from tokenloom.config.schema import AdminConfig, ConfigError
from tokenloom.daemon import logs
from tokenloom.daemon.admin import cli as admin_cli
from tokenloom.daemon.admin import protocol as P
from tokenloom.daemon.admin.server import allowed
from tokenloom.daemon.inflight import InFlight


@pytest.mark.parametrize("line, expected", [
    (b'{"cmd": "stats"}\n', P.Stats()),
    (b'{"cmd": "flush-cache"}', P.FlushCache(force=False)),
    (b'{"cmd": "flush-cache", "force": true}', P.FlushCache(force=True)),
    (b'{"cmd": "drain", "timeout": 2.5, "wait": true}', P.Drain(timeout=2.5, wait=True)),
    (b'{"cmd": "drain"}', P.Drain(timeout=None, wait=False)),
    (b'{"cmd": "resume"}', P.Resume()),
    (b'{"cmd": "cancel", "request_id": "cmpl-1"}', P.Cancel(request_id="cmpl-1")),
    (b'{"cmd": "trace", "request_id": "cmpl-1"}', P.Trace(request_id="cmpl-1")),
    (b'{"cmd": "log-level", "level": "debug"}', P.SetLogLevel(level="debug")),
])
def test_commands_decode(line, expected):
    assert P.decode_command(line) == expected


def test_commands_round_trip():
    for cmd in (P.Stats(), P.FlushCache(force=True), P.Drain(timeout=1.0, wait=True),
                P.Cancel(request_id="x"), P.SetLogLevel(level="error")):
        line = P.encode(cmd)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert P.decode_command(line) == cmd


@pytest.mark.parametrize("line, code, words", [
    (b"{not json", "bad_request", "not JSON"),
    (b"", "bad_request", "not JSON"),
    (b"[1, 2]", "bad_request", '"cmd"'),
    (b'{"command": "stats"}', "bad_request", '"cmd"'),
    (b'{"cmd": 3}', "bad_request", '"cmd"'),
    (b'{"cmd": "reboot"}', "unknown_command", "unknown command 'reboot'"),
    (b'{"cmd": "flush-cache", "forse": true}', "bad_request", "forse"),
    (b'{"cmd": "flush-cache", "force": "yes"}', "bad_request", "force"),
    (b'{"cmd": "cancel"}', "bad_request", "request_id"),
    (b'{"cmd": "log-level", "level": "loud"}', "bad_request", "level"),
    (b'{"cmd": "drain", "timeout": -1}', "bad_request", "timeout"),
    (b'\xff\xfe', "bad_request", "not JSON"),
])
def test_bad_commands_become_error_replies(line, code, words):
    with pytest.raises(P.ProtocolError) as e:
        P.decode_command(line)
    reply = e.value.reply
    assert isinstance(reply, P.ErrorReply) and not reply.ok
    assert reply.code == code and reply.code in P.ERROR_CODES
    assert words in reply.error


def test_unknown_command_lists_the_commands():
    with pytest.raises(P.ProtocolError) as e:
        P.decode_command(b'{"cmd": "nope"}')
    for name in ("stats", "flush-cache", "drain", "resume", "cancel", "trace", "log-level"):
        assert name in e.value.reply.error


def test_replies_are_tagged_and_typed():
    line = P.encode(P.FlushCacheReply(freed=3))
    assert msgspec.json.decode(line) == {"reply": "flush-cache", "ok": True, "freed": 3}
    assert P.decode_reply(line) == P.FlushCacheReply(freed=3)
    err = P.decode_reply(P.encode(P.ErrorReply(code="refused", error="no")))
    assert isinstance(err, P.ErrorReply) and err.ok is False


@pytest.mark.parametrize("cfg, uid, gid, groups, ok", [
    (AdminConfig(), 1234, 1234, set(), True),            # own uid (own_uid=1234 below)
    (AdminConfig(), 0, 0, set(), True),                  # root
    (AdminConfig(), 999, 999, set(), False),
    (AdminConfig(allowed_uids=[999]), 999, 5, set(), True),
    (AdminConfig(allowed_uids=[999]), 0, 0, set(), False),  # an explicit list replaces root
    (AdminConfig(allowed_uids=[999]), 1234, 5, set(), False),
    (AdminConfig(allowed_gids=[50]), 777, 50, set(), True),   # primary gid
    (AdminConfig(allowed_gids=[50]), 777, 7, {7, 50}, True),  # supplementary group
    (AdminConfig(allowed_gids=[50]), 777, 7, {7}, False),
])
def test_peer_allow_list(cfg, uid, gid, groups, ok):
    assert allowed(cfg, uid, gid, groups, own_uid=1234) is ok


def test_admin_config_validates_id_lists():
    with pytest.raises(ConfigError, match="admin.allowed_uids must be integers"):
        AdminConfig(allowed_uids=[-1])
    with pytest.raises(ConfigError, match="admin.allowed_gids must be integers"):
        AdminConfig(allowed_gids=["wheel"])
    with pytest.raises(ConfigError, match="admin.read_timeout_seconds must be > 0.0"):
        AdminConfig(read_timeout_seconds=0)
    with pytest.raises(ConfigError, match="admin.max_line_bytes must be >= 256"):
        AdminConfig(max_line_bytes=10)


def test_cli_renders_every_reply():
    progress = P.DrainProgress(draining=True, in_flight=2, elapsed_seconds=1.5,
                               timeout_seconds=10.0, drained=False, timed_out=False,
                               exiting=False)
    assert admin_cli.render(P.DrainReply(progress=progress)) == \
        "draining: 2 request(s) in flight, 1.5 s elapsed, timeout 10 s"
    assert admin_cli.render(P.FlushCacheReply(freed=4)) == "prefix cache flushed: 4 block(s) freed"
    assert admin_cli.render(P.ErrorReply(code="refused", error="busy")) == "error (refused): busy"
    assert admin_cli.render(P.LogLevelReply(level="debug", previous="info")) == \
        "log level: info -> debug"
    assert "cmpl-1-0, cmpl-1-1" in admin_cli.render(
        P.CancelReply(request_id="cmpl-1", cancelled=["cmpl-1-0", "cmpl-1-1"]))
    from tokenloom.actors.kv.prefix_cache import PrefixCacheStats
    from tokenloom.actors.messages import EngineStats, KVStats, RouterStats, SchedulerStats
    sched = SchedulerStats(waiting=2, running=3, in_flight_steps=0, overlap=True, num_steps=4,
                           num_forks=0, num_preemptions=0, num_swap_preemptions=0,
                           num_free_blocks=75, max_decode_skip=0, admission_paused=False,
                           prefill_budget=None, cost_model=None, swap_free_slots=None,
                           num_slo_evaluated=0, num_slo_good=0)
    kv = KVStats(num_blocks=100, free=75, used=25, usage=0.25, block_size=16, cached_blocks=5,
                 prefix_cache=PrefixCacheStats(queried_tokens=10, hit_tokens=5))
    engine = EngineStats(scheduler=sched, kv=kv,
                         router=RouterStats(in_flight=1, capacity=8, num_rejected=0))
    stats = P.StatsReply(model="m", ready=True, uptime_seconds=3, log_level="info", in_flight=1,
                         engine_stalled_seconds=0.0, engine=engine,
                         drain=msgspec.structs.replace(progress, draining=False))
    text = admin_cli.render(stats)
    assert "25 / 75 / 100 (25.0% used)" in text and "50.0% (5 / 10 tokens)" in text
    assert "not draining" in text
    # every field of the engine's stats is shown, by section (a new counter needs no edit)
    assert "engine.scheduler.num_forks" in text and "engine.kv.prefix_cache.hit_tokens" in text
    assert "engine.graphs.graph_steps" in text


def test_cli_builds_commands_from_arguments():
    parser = __import__("tokenloom.daemon.__main__", fromlist=["build_parser"]).build_parser()
    args = parser.parse_args(["admin", "--socket", "/x", "drain", "--timeout", "5", "--wait"])
    assert admin_cli.build_command(args) == P.Drain(timeout=5.0, wait=True)
    args = parser.parse_args(["admin", "flush-cache", "--force"])
    assert admin_cli.build_command(args) == P.FlushCache(force=True)
    args = parser.parse_args(["admin", "cancel", "cmpl-9"])
    assert admin_cli.build_command(args) == P.Cancel(request_id="cmpl-9")
    with pytest.raises(SystemExit):
        parser.parse_args(["admin", "log-level", "loud"])


def test_inflight_maps_client_ids_to_engine_ids():
    class Gen:
        def __init__(self, *rids):
            self.choices = dict.fromkeys(rids)

    reg = InFlight()
    reg.add("cmpl-a", Gen("cmpl-a"))
    reg.add("cmpl-b", Gen("cmpl-b-0", "cmpl-b-1"))
    assert len(reg) == 2 and "cmpl-b" in reg
    assert reg.engine_ids("cmpl-a") == ["cmpl-a"]
    assert reg.engine_ids("cmpl-b") == ["cmpl-b-0", "cmpl-b-1"]
    assert reg.engine_ids("cmpl-b-1") == ["cmpl-b-1"]
    assert reg.engine_ids("cmpl-c") == []
    reg.remove("cmpl-b")
    reg.remove("cmpl-b")  # idempotent
    assert len(reg) == 1 and reg.engine_ids("cmpl-b") == []


def test_log_level_changes_at_run_time_even_for_bound_loggers():
    import io

    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    logs.configure("info", stream=stream)
    try:
        bound = logs.structlog.get_logger("t").bind(actor="x")  # bound before the change
        bound.debug("hidden")
        assert logs.set_level("debug") == "info" and logs.current_level() == "debug"
        bound.debug("shown")
        logs.set_level("error")
        bound.warning("hidden too")
        bound.error("shown too")
        assert logging.getLogger().level == logging.ERROR
        with pytest.raises(ValueError, match="log level must be one of"):
            logs.set_level("loud")
    finally:
        logs.set_level("info")
        logs.structlog.reset_defaults()  # other tests log as if nothing was configured
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    out = stream.getvalue()
    assert "shown" in out and "shown too" in out and "hidden" not in out
