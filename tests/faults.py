"""Fault injection for tests: raise inside the engine at a named point, for chosen requests.

Test-only by construction: this module lives under tests/ (never installed with the
package), refuses to import unless `TOKENLOOM_FAULT_INJECTION=1` is set, and touches the
engine only by wrapping methods once `install()` is called. Production code has no hook to
switch on: without this module nothing is wrapped.

A fault targets the requests of one tenant (the body's `user`, or X-Tenant), so a test
marks its victim before sending it, with no race against a fast engine:

    injector = faults.install()
    injector.arm("detokenize", tenant="victim", after=3)   # the 4th token's text raises
    ... send {"user": "victim", ...} ...
    assert injector.fired("detokenize") == 1

Points (each wraps one method; `after` skips that many matching calls first):
- forward       ModelRunner._forward: a step containing the victim raises (the step's
                requests fail; the runner goes on)
- sampler       the sampler (host or on-device) of such a step raises
- detokenize    OutputProcessor.text for the victim's token raises
- stream_output StreamRegistry delivering one of the victim's outputs raises
- kv_allocate   KVCacheManager.allocate raises when a grant is for the victim
- kv_actor      the KV manager actor raises while handling an update that involves the
                victim: the actor dies, and the engine with it (cannot make progress)

For a server in a subprocess: `TOKENLOOM_FAULTS='[{"point": ..., "tenant": ...}]'` and
`install_from_env()` in the child before it serves (see tests/daemon/test_supervisor.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading

if os.environ.get("TOKENLOOM_FAULT_INJECTION") != "1":
    raise ImportError("faults is a test-only module: set TOKENLOOM_FAULT_INJECTION=1 to use it")

POINTS = ("forward", "sampler", "detokenize", "stream_output", "kv_allocate", "kv_actor")


class InjectedFault(RuntimeError):
    pass


@dataclasses.dataclass
class Fault:
    point: str
    tenant: str
    after: int = 0          # matching calls to let through first
    times: int = 1          # then raise this many times
    seen: int = 0
    fired: int = 0


class Injector:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._victims: dict[str, str] = {}      # engine request id -> tenant
        self._fired: dict[str, int] = {p: 0 for p in POINTS}
        self._undo: list = []
        self._local = threading.local()         # the step's request ids (runner thread)

    # -- arming ----------------------------------------------------------------------------
    def arm(self, point: str, tenant: str, after: int = 0, times: int = 1) -> None:
        if point not in POINTS:
            raise ValueError(f"unknown fault point {point!r} (known: {', '.join(POINTS)})")
        with self._lock:
            self._faults.append(Fault(point, tenant, after, times))

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def fired(self, point: str) -> int:
        with self._lock:
            return self._fired[point]

    # -- the check at every wrapped call ---------------------------------------------------
    def check(self, point: str, request_ids) -> None:
        with self._lock:
            tenants = {self._victims.get(rid) for rid in request_ids} - {None}
            for f in self._faults:
                if f.point != point or f.tenant not in tenants or f.fired >= f.times:
                    continue
                f.seen += 1
                if f.seen <= f.after:
                    continue
                f.fired += 1
                self._fired[point] += 1
                raise InjectedFault(f"injected fault at {point}")

    # -- installation ----------------------------------------------------------------------
    def _wrap(self, owner, name: str, make) -> None:
        original = owner.__dict__[name]
        setattr(owner, name, make(original))
        self._undo.append((owner, name, original))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def install() -> Injector:
    """Wrap the fault points (once per process; `uninstall()` undoes it)."""
    from tokenloom.actors.engine_client import EngineFront
    from tokenloom.actors.execution import model_runner
    from tokenloom.actors.front.streams import StreamRegistry
    from tokenloom.actors.kv.kv_actor import KVManagerActor
    from tokenloom.actors.kv.kv_manager import KVCacheManager
    from tokenloom.actors.output.output_processor import OutputProcessor

    inj = Injector()

    def submit(original):
        def wrapper(self, request, queue=None):
            tenant = request.meta.tenant
            if tenant is not None:
                with inj._lock:
                    inj._victims[request.request_id] = tenant
            return original(self, request, queue)
        return wrapper

    def forward(original):
        def wrapper(self, batch, *args, **kwargs):
            ids = [s.request_id for s in batch.sequences]
            inj._local.ids = ids
            inj.check("forward", ids)
            return original(self, batch, *args, **kwargs)
        return wrapper

    def sampler(original):
        def wrapper(*args, **kwargs):
            inj.check("sampler", getattr(inj._local, "ids", ()))
            return original(*args, **kwargs)
        return wrapper

    def detokenize(original):
        fn = original.__func__

        def wrapper(req, token_ids):
            inj.check("detokenize", (req.request_id,))
            return fn(req, token_ids)
        return staticmethod(wrapper)

    def deliver(original):
        fn = original.__func__

        def wrapper(queue, out):
            inj.check("stream_output", (out.request_id,))
            return fn(queue, out)
        return staticmethod(wrapper)

    def allocate(original):
        def wrapper(self, grants, *args, **kwargs):
            inj.check("kv_allocate", [rid for rid, _ in grants])
            return original(self, grants, *args, **kwargs)
        return wrapper

    def kv_apply(original):
        def wrapper(self, update):
            ids = [rid for rid, _ in update.grants] + [a.request_id for a in update.admissions]
            inj.check("kv_actor", ids)
            return original(self, update)
        return wrapper

    inj._wrap(EngineFront, "submit", submit)
    inj._wrap(model_runner.ModelRunner, "_forward", forward)
    for name in ("sample", "sample_ids_on_device"):
        original = getattr(model_runner, name)
        setattr(model_runner, name, sampler(original))
        inj._undo.append((model_runner, name, original))
    inj._wrap(OutputProcessor, "text", detokenize)
    inj._wrap(StreamRegistry, "_deliver", deliver)
    inj._wrap(KVCacheManager, "allocate", allocate)
    inj._wrap(KVManagerActor, "apply", kv_apply)
    return inj


def install_from_env() -> Injector:
    """install(), then arm every fault in $TOKENLOOM_FAULTS (a JSON list of
    {"point", "tenant", "after"?, "times"?})."""
    inj = install()
    for spec in json.loads(os.environ.get("TOKENLOOM_FAULTS", "[]")):
        inj.arm(**spec)
    return inj
