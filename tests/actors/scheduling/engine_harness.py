"""The real engine core — SchedulerActor and KVManagerActor, wired as actors/engine.py wires
them — on an asyncio loop, with a fake runner in place of the model.

The fake runner (FakeRunner) is the runner actor's contract — `send(ExecuteBatch)`, called
synchronously by the scheduler; batches executed in order, each `lag` loop iterations
after it was sent (so with overlap the scheduler really runs one step ahead); a
StepOutput per batch into the scheduler's inbox — over a fake KV cache (block id -> the
token id stored at each offset; host swap slots the same way). For every batch it checks
end to end that the scheduler and the KV manager kept KV and tokens exact:

1. batch limits (max_num_seqs, max_num_batched_tokens, decodes first with one token);
   requests finished before the batch was sent are dropped by its finished_ids;
2. it applies the swap-outs, swap-ins (from slots some swap-out wrote) and block copies;
3. for each sequence: a NewSequence agrees with what the runner knows of the request
   (its prompt; after a preemption, the outputs it sampled); a PLACEHOLDER (overlap only,
   the single token of a decode) becomes the token it sampled last for that request;
   every context position [0, start_pos) holds the request's true token in its block
   table (true tokens: the prompt plus what the runner sampled for it), the tokens to
   compute are the true ones, the table has exactly the blocks for them;
4. it writes the new tokens' "KV" into the table's blocks and samples a deterministic
   token (`sampled_token`, never EOS) exactly when the step completes the request's known
   tokens, as the scheduler's `sample` flag must say.
5. speculative decoding (Setup.spec_k > 0, prompt lookup in mode "on"): it proposes the
   request's true next tokens, one of them wrong on most steps, and verifies drafts as a
   model would (accepted while they equal the true tokens, then the true token). Drafts'
   "KV" is written like any other, so a rejected draft left unrolled-back would be read
   as context by a later step and caught by check 3.
So preemption (recompute and swap), prefix-cache hits, n > 1 forks (copy-on-write),
chunked prefill, overlap placeholders and speculative rollback are all checked by what a
real model would read.

Time is counted in iterations (batches executed). Arrivals due at iteration i are added
just before batch i's output is posted (`event_lag` loop iterations later, to land
anywhere, e.g. during a KV round trip); when every request added so far has finished
and the engine is idle, the next arrivals come at once. Requests finish by length
(ignore_eos), or by an abort: once the runner has sampled `abort_after` of their tokens,
or `abort_delay` steps after they were added. A scheduler blocked on its inbox with
requests waiting and nothing on its way to it is reported as stuck; a scenario has
`liveness_bound` steps and `timeout` seconds.

`run_scenario` runs one and `check()`s the end state: every request finished exactly
once, by length with exactly max_tokens tokens — those the runner sampled, none sampled
in vain — or by abort with a prefix of them; no running decode ever skipped (with sliding
windows: never two steps running); the KV pool
whole and sound, swap slots free, no finished request's state left on the runner, the
scheduler's registry empty. KNOWN_BUGS lists the scheduler bugs it tolerates by default.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import zlib
from collections import Counter, deque

import numpy as np
from structlog.testing import capture_logs

from tokenloom.actors.kv.groups import NULL_BLOCK, KVGroups
from tokenloom.actors.kv.kv_actor import KVManagerActor
from tokenloom.actors.kv.kv_manager import KVCacheManager
from tokenloom.actors.messages import (
    PLACEHOLDER,
    AbortRequest,
    AddRequest,
    CheckIntegrity,
    ExecuteBatch,
    ForgetRequests,
    GetKVStats,
    IsIdle,
    KVGrant,
    KVStats,
    KVUpdate,
    OffloadKV,
    RequestMeta,
    RequestOutput,
    SampledToken,
    Shutdown,
    SpecResult,
    StepOutput,
)
from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.actors.scheduling.policy import PolicyLimits
from tokenloom.actors.scheduling.prefix_tracker import PrefixTracker
from tokenloom.actors.scheduling.scheduler import Scheduler
from tokenloom.actors.scheduling.scheduler_actor import SchedulerActor
from tokenloom.actors.scheduling.swap import SwapSpace
from tokenloom.actors.speculation.controller import SpecController
from tokenloom.arith import cdiv
from tokenloom.config.schema import SchedulerConfig

VOCAB = 1000
EOS = 0   # in no prompt and never sampled: requests end by length (or abort) only


def sampled_token(request_id: str, position: int) -> int:
    """The fake model's token for `request_id` at `position` (deterministic, never EOS)."""
    return 1 + zlib.crc32(f"{request_id}@{position}".encode()) % (VOCAB - 1)


MAX_RUN = 1024


@functools.lru_cache(maxsize=256)
def _run(key: str) -> tuple[int, ...]:
    return tuple(1 + zlib.crc32(f"{key}#{j}".encode()) % (VOCAB - 1) for j in range(MAX_RUN))


class Tokens(tuple):
    """Token ids that print as the expression that makes them (falsifying examples stay
    short and can be pasted back)."""

    def __new__(cls, tokens, spec: str):
        t = super().__new__(cls, tokens)
        t.spec = spec
        return t

    def __repr__(self) -> str:
        return self.spec

    def __add__(self, other):
        return Tokens(tuple(self) + tuple(other), f"{self!r} + {other!r}")


def token_run(key: str, length: int) -> Tokens:
    """`length` (<= MAX_RUN) deterministic prompt tokens named by `key` (never EOS); runs
    with the same key share their prefixes, so prompts built from them share prefix-cache
    blocks."""
    assert length <= MAX_RUN
    return Tokens(_run(key)[:length], f"token_run({key!r}, {length})")


@dataclasses.dataclass(frozen=True)
class Arrival:
    iteration: int
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    tenant: str | None = None
    cache_salt: str | None = None
    # n > 1: the index of sibling 0's arrival (same prompt, same iteration, earlier in the
    # list); the request is added with group_id = sibling 0's id, as fan_out makes them.
    sibling_of: int | None = None
    # Abort the request once the runner has sampled this many of its tokens (0: once it
    # has been in one step); the abort reaches the scheduler before that step's output.
    abort_after: int | None = None
    # Abort it this many steps after it was added, wherever it is then (waiting, preempted,
    # running or already finished: aborts are idempotent).
    abort_delay: int | None = None


def request_id(index: int) -> str:
    return f"r{index}"


@dataclasses.dataclass(frozen=True)
class Setup:
    limits: PolicyLimits
    config: SchedulerConfig
    prefix_caching: bool = False
    swap_slots: int = 0            # host swap slots (0: no swap space, recompute only)
    block_bytes: int = 1 << 16     # a block's KV bytes (the "auto" mode's copy cost)
    # Loop iterations between a batch reaching the runner and its execution: 0 runs it as
    # soon as the scheduler yields; more lets the scheduler plan and send the next batch
    # first (with overlap: two batches queued at the runner, as on a busy device).
    lag: int = 0
    # Loop iterations the front end takes to deliver an arrival or abort that is due: 0
    # puts it in the scheduler's inbox before the step's output; more lets it land
    # anywhere, e.g. during a KV round trip (in order: an abort never overtakes its add).
    event_lag: int = 0
    max_model_len: int | None = None   # default: the pool's capacity, as Engine.build does
    spec_k: int = 0                    # speculative tokens per step (0: no speculation)
    # KV tiers (prefix caching only): a host tier of this many blocks (0: off), whose every
    # `tier_fail`-th read fails (0: none), so restores that stop part-way are drawn too.
    tier_blocks: int = 0
    tier_fail: int = 0
    # The model's layer groups (actors/kv/groups.py); None: one group without a window.
    kv_groups: KVGroups | None = None


def setup(max_num_seqs: int, max_num_batched_tokens: int, block_size: int, num_blocks: int,
          *, prefix_caching: bool = False, swap_slots: int = 0, lag: int = 0,
          event_lag: int = 0, spec_k: int = 0, tier_blocks: int = 0, tier_fail: int = 0,
          kv_windows: tuple[int | None, ...] | None = None, **config) -> Setup:
    """A Setup from the policy limits and SchedulerConfig fields. Unless given, the KV plan
    is off (no watermark, no lookahead) and classes do not age. `kv_windows`: one window
    per layer (None: full attention), whose groups split the pool (`num_blocks` usable
    blocks; a sliding layout's pool has one more, its NULL_BLOCK)."""
    config = {"kv_watermark": 0.0, "kv_resume_watermark": 0.0,
              "admission_lookahead_tokens": 0, "aging_seconds": 0.0, **config}
    groups = KVGroups.plan(kv_windows) if kv_windows is not None else None
    return Setup(limits=PolicyLimits(max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens,
                                     block_size=block_size, num_blocks=num_blocks,
                                     kv_groups=groups),
                 kv_groups=groups,
                 config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max_num_batched_tokens,
                                        **config),
                 prefix_caching=prefix_caching, swap_slots=swap_slots, lag=lag,
                 event_lag=event_lag, spec_k=spec_k, tier_blocks=tier_blocks,
                 tier_fail=tier_fail)


def kv_tokens(a: Arrival) -> int:
    """Tokens a request's table holds at most: its last sampled token is never fed back."""
    return len(a.prompt) + a.max_tokens - 1


def smallest_pool(arrivals: list[Arrival], block_size: int) -> int:
    """Blocks for the biggest request alone, with room for prompt + max_tokens in the
    context window (max_model_len is the pool's capacity, as in the engine)."""
    return max(cdiv(len(a.prompt) + a.max_tokens, block_size) for a in arrivals)


def liveness_bound(arrivals: list[Arrival]) -> int:
    """Batches within which every scenario must complete: each batch computes >= 1 token;
    8x the tokens leaves room for recomputation after preemptions."""
    total = sum(len(a.prompt) + a.max_tokens for a in arrivals)
    return max(a.iteration for a in arrivals) + 1 + 8 * total


class HarnessError(AssertionError):
    pass


# Scheduler bugs `check` can tolerate (by name), so that the property tests could keep
# guarding everything else while one was open; none is open. The names the harness knows:
# "preempted-abort-leak", "fork-abort-crash", "swap-out-dropped", "idle-arrival-stall",
# "abort-stall" (see test_scheduler_properties.py, "regressions", for each scenario).
KNOWN_BUGS: frozenset[str] = frozenset()


@dataclasses.dataclass
class _Seq:
    """What the fake runner knows of a request: its prompt and the tokens it sampled."""
    prompt: list[int]
    sampled: list[int]


def _host_tier(block_size: int, blocks: int, fail_every: int):
    """A TierManager with one host tier holding a block's tokens as its bytes; every
    `fail_every`-th read fails (the block is not returned), to draw partial restores."""
    from tokenloom.actors.kv.tiers.calibration import TransferModel
    from tokenloom.actors.kv.tiers.manager import TierManager, WritePolicy
    from tokenloom.actors.kv.tiers.planner import RecomputeCost  # noqa: F401
    from tokenloom.actors.kv.tiers.record import KVLayout
    from tokenloom.actors.kv.tiers.store import HostStore

    layout = KVLayout("int32", (block_size,), 4)

    class FlakyHost(HostStore):
        reads = 0

        def get(self, block_hash):
            self.reads += 1
            if fail_every and self.reads % fail_every == 0:
                return None
            return super().get(block_hash)

    return TierManager(layout, [FlakyHost(layout, blocks * layout.block_bytes)],
                       {"host": WritePolicy("back")}, {"host": TransferModel(0.0, 1e12)},
                       block_size=block_size)


class FakeRunner:
    """The runner actor's contract (send(ExecuteBatch) from the scheduler, StepOutputs to
    its inbox, batches executed in order) over a fake KV cache that checks every read."""

    def __init__(self, harness: "EngineHarness"):
        self.h = harness
        self.bs = harness.setup.limits.block_size
        self.kv: dict[int, list[int | None]] = {}     # block id -> token at each offset
        self.host: dict[int, list[int | None]] = {}   # swap slot -> a block's contents
        self.seqs: dict[str, _Seq] = {}               # per-request state (finished_ids drop it)
        self.sampled: dict[str, list[int]] = {}       # every token sampled, kept for checks
        self.computed: Counter[str] = Counter()       # tokens computed per request
        self.first_step: dict[str, int] = {}          # step a request first ran in
        self.queue: deque[tuple[ExecuteBatch, frozenset[str], list]] = deque()
        # Swap-outs the KV manager granted that no batch has carried yet (see send).
        self.granted_swap_outs: list[list[tuple[int, int]]] = []
        self.batches: list[ExecuteBatch] = []
        self.executed = 0
        self.max_queued = 0          # batches sent but not yet executed, at most
        self.num_placeholders = 0
        self.num_swapped_in = 0
        self.num_copies = 0
        self.num_restored = 0

    # -- the runner actor's interface ----------------------------------------------------
    def send(self, batch) -> None:
        if isinstance(batch, (ForgetRequests, OffloadKV)):   # idle: applied in order
            finished = self.h.finished_at_last_send = frozenset(self.h.finished)
            self.queue.append((batch, finished, []))
            self._tick(self.h.setup.lag)
            return
        # Every request finished so far must be gone from the runner once this batch's
        # finished_ids are applied.
        finished = self.h.finished_at_last_send = frozenset(self.h.finished)
        # The batch carries the swap-outs of the grant it was built from; any older ones
        # were granted (their blocks freed, maybe reused) but never sent.
        pending = self.granted_swap_outs
        if batch.swap_out and pending and pending[-1] == batch.swap_out:
            pending.pop()
        dropped = [pair for pairs in pending for pair in pairs]
        pending.clear()
        if dropped and "swap-out-dropped" not in self.h.tolerate:
            self.h.fail(HarnessError(f"step {batch.step}: swap-outs {dropped} granted by the KV "
                                     f"manager were never sent to the runner"))
        self.queue.append((batch, finished, dropped))
        # (a ForgetRequests still on its way is not a batch: the serial loop may send one
        # when it goes idle and a batch right after, when a request arrives)
        queued = sum(isinstance(b, ExecuteBatch) for b, _, _ in self.queue)
        self.max_queued = max(self.max_queued, queued)
        self._tick(self.h.setup.lag)

    def _tick(self, hops: int) -> None:
        if hops:
            self.h.loop.call_soon(self._tick, hops - 1)
            return
        batch, finished_before, dropped = self.queue.popleft()   # in the order sent
        if self.h.failure is not None:
            return   # stopped at the first failure
        if isinstance(batch, OffloadKV):
            self._offload(batch.offloads)
            return
        if isinstance(batch, ForgetRequests):
            for rid in batch.request_ids:
                _check(rid in self.seqs, f"ForgetRequests names {rid}, unknown here")
                del self.seqs[rid]
            return
        try:
            out = self._execute(batch, finished_before, dropped)
        except BaseException as e:  # noqa: BLE001 - reported by the harness
            self.h.fail(e)
            return
        self.h.before_output(batch)
        self.h.scheduler.inbox.put_nowait(out)

    # -- one step ------------------------------------------------------------------------
    def _execute(self, batch: ExecuteBatch, finished_before: frozenset[str],
                 dropped_swap_outs: list[tuple[int, int]]) -> StepOutput:
        lim = self.h.setup.limits
        self.executed += 1
        self.batches.append(batch)
        step = batch.step
        _check(step == self.executed, f"step {step} executed as batch {self.executed}")
        seqs = batch.sequences
        rids = [s.request_id for s in seqs]
        num_tokens = sum(len(s.token_ids) for s in seqs)
        _check(seqs or batch.swap_out or batch.swap_in or batch.block_copies
               or batch.kv_offloads, f"step {step} is empty (no sequences and no KV copies)")
        _check(len(set(rids)) == len(rids), f"step {step} has a request twice: {rids}")
        _check(len(seqs) <= lim.max_num_seqs,
               f"step {step}: {len(seqs)} sequences > max_num_seqs {lim.max_num_seqs}")
        _check(num_tokens <= lim.max_num_batched_tokens,
               f"step {step}: {num_tokens} tokens > max_num_batched_tokens "
               f"{lim.max_num_batched_tokens}")
        _check(all(len(s.token_ids) == 1 for s in seqs[:batch.num_decodes]),
               f"step {step}: a decode with several tokens")
        for rid in batch.finished_ids:
            _check(rid in self.seqs, f"step {step}: finished_ids names {rid}, unknown here")
            del self.seqs[rid]
        leaked = finished_before & self.seqs.keys() - self.h.tolerated_leaks()
        _check(not leaked, f"step {step}: the runner still holds the state of finished "
                           f"requests {sorted(leaked)} (never named in finished_ids)")
        blank = [None] * self.bs
        # In the runner's order, the KV manager's within one update: tier offloads (before
        # anything overwrites an evicted block), swap-outs (then freed: a fork's copy may
        # land in one), fork copies, swap-ins, tier restores.
        self._offload(batch.kv_offloads)
        for blk, slot in dropped_swap_outs + batch.swap_out:
            self.host[slot] = list(self.kv.get(blk, blank))
        for src, dst in batch.block_copies:
            self.kv[dst] = list(self.kv.get(src, blank))
            self.num_copies += 1
        for slot, blk in batch.swap_in:
            _check(slot in self.host, f"step {step}: swap-in from host slot {slot}, which no "
                                      f"swap-out wrote")
            self.kv[blk] = self.host.pop(slot)
            self.num_swapped_in += 1
        for blk, payload in batch.kv_restores:
            self.kv[blk] = [None if t < 0 else int(t)
                            for t in np.frombuffer(payload.tobytes(), dtype=np.int32)]
            self.num_restored += 1
        sampled, spec = [], []
        for i, s in enumerate(seqs):
            toks = self._run_sequence(step, i < batch.num_decodes, s)
            sampled += [SampledToken(request_id=s.request_id, token_id=t) for t in toks]
            if s.num_draft or s.propose:
                spec.append(SpecResult(request_id=s.request_id, num_draft=s.num_draft,
                                       num_accepted=max(0, len(toks) - 1) if s.num_draft
                                       else 0, proposals=self._propose(step, s)))
        swaps = len(batch.swap_out) + len(batch.swap_in)
        return StepOutput(step=step, sampled=sampled, compute_seconds=1e-3 + 1e-4 * num_tokens,
                          swap_seconds=1e-5 * swaps, spec=spec)

    def _offload(self, offloads) -> None:
        """KV tiers: the blocks' tokens, as the bytes of their KV, to the tier manager."""
        if not offloads:
            return
        blank = [None] * self.bs
        rows = np.stack([np.array([-1 if t is None else t for t in self.kv.get(b, blank)],
                                  dtype=np.int32).view(np.uint8) for b, _, _ in offloads])
        self.h.tiers.offer([m for _, m, _ in offloads], rows, [c for *_, c in offloads])

    def _check_group(self, where: str, g: int, table: list[int], start: int, end: int,
                     truth: list[int]) -> None:
        """Layer group g's table for a work computing [start, end): exactly the blocks for
        [0, end) (grants are exact; with speculation, blocks of rolled-back drafts may
        stay), NULL_BLOCK exactly behind a sliding group's window, and every key the
        first query reads holding the request's token."""
        bs, groups = self.bs, self.h.setup.kv_groups
        need = cdiv(end, bs)
        _check(len(table) >= need if self.h.setup.spec_k else len(table) == need,
               f"{where}: group {g}'s table {table} for positions [0, {end})")
        window = groups.windows[g] if groups is not None else None
        first = groups.first_kept_block(g, start, bs) if groups is not None else 0
        held = table[first:]
        _check(all(b == NULL_BLOCK for b in table[:first]) and NULL_BLOCK not in held
               if groups is not None and groups.hybrid else True,
               f"{where}: group {g}'s table {table}: NULL_BLOCK must be exactly behind the "
               f"window (blocks before {first})")
        _check(len(set(held)) == len(held), f"{where}: group {g}'s table {table} repeats")
        lo_key = 0 if window is None else max(0, start - window + 1)
        for b in range(first, cdiv(start, bs)):  # the context the first query reads
            lo, hi = max(b * bs, lo_key), min((b + 1) * bs, start)
            got = self.kv.get(table[b], [None] * bs)[lo - b * bs:hi - b * bs]
            _check(list(got) == truth[lo:hi],
                   f"{where}: group {g}'s block {table[b]} (positions {lo}..{hi - 1}) holds "
                   f"{list(got)}, the request's tokens are {truth[lo:hi]}")

    def _propose(self, step: int, s) -> list[int]:
        """The request's true next tokens, one of them wrong on two steps in three."""
        if not s.propose:
            return []
        st = self.seqs[s.request_id]
        n = len(st.prompt) + len(st.sampled)
        out = [sampled_token(s.request_id, n + j) for j in range(s.propose)]
        if step % 3:
            j = step % len(out)
            out[j] = 1 + out[j] % (VOCAB - 1)
        return out

    def _run_sequence(self, step: int, is_decode: bool, s) -> list[int]:
        rid, bs = s.request_id, self.bs
        where = f"step {step}, {rid}"
        st = self.seqs.get(rid)
        if s.new is not None:
            new = s.new
            if st is None:
                _check(rid not in self.sampled, f"{where}: the runner dropped its state "
                                                f"but it runs again")
                _check(list(new.prompt_token_ids) == list(self.h.prompts[rid]),
                       f"{where}: NewSequence with the wrong prompt")
                _check(not new.output_token_ids, f"{where}: a first NewSequence with outputs")
                st = self.seqs[rid] = _Seq(list(new.prompt_token_ids), [])
                self.sampled[rid] = st.sampled
            else:  # resumed after a preemption: the scheduler resends what it knows
                _check(list(new.prompt_token_ids) == st.prompt,
                       f"{where}: resumed with a different prompt")
                _check(list(new.output_token_ids) == st.sampled,
                       f"{where}: resumed with outputs {list(new.output_token_ids)}, the runner "
                       f"sampled {st.sampled}")
        _check(st is not None, f"{where}: scheduled without a NewSequence")
        truth = st.prompt + st.sampled
        start, ids = s.start_pos, list(s.token_ids)
        end = start + len(ids)
        drafts = []
        if s.num_draft:
            _check(self.h.setup.spec_k and s.sample and start + 1 == len(truth),
                   f"{where}: {s.num_draft} drafts after position {start} of {len(truth)}")
            drafts = ids[1:]
            ids, end = ids[:1], start + 1
        if PLACEHOLDER in ids:
            _check(self.h.setup.config.overlap, f"{where}: a placeholder with overlap off")
            _check(is_decode and len(ids) == 1 and st.sampled,
                   f"{where}: a placeholder outside a decode: {ids}")
            _check(end == len(truth), f"{where}: a placeholder at position {start}, but the "
                                      f"last sampled token is at {len(truth) - 1}")
            ids[0] = st.sampled[-1]
            self.num_placeholders += 1
        _check(end <= len(truth), f"{where}: computes positions [{start}, {end}) of a request "
                                  f"with {len(truth)} tokens")
        _check(ids == truth[start:end], f"{where}: computes tokens {ids} at {start}, the "
                                        f"request's are {truth[start:end]}")
        groups = self.h.setup.kv_groups
        tables = [s.block_table, *(s.group_tables or [])]
        _check(len(tables) == (groups.num_groups if groups is not None else 1),
               f"{where}: {len(tables)} block tables")
        for g, table in enumerate(tables):
            self._check_group(where, g, table, start, end + len(drafts), truth)
        for table in tables:
            for p, t in enumerate(ids + drafts, start):
                self.kv.setdefault(table[p // bs], [None] * bs)[p % bs] = t
        self.computed[rid] += len(ids)
        self.first_step.setdefault(rid, step)
        if not s.sample:
            _check(end < len(truth), f"{where}: completes its known tokens without sampling")
            return []
        _check(end == len(truth), f"{where}: samples after position {end - 1} of "
                                  f"{len(truth)} known tokens")
        out = []
        for d in drafts + [None]:   # verification: accepted while true, then the true one
            tok = sampled_token(rid, end + len(out))
            out.append(tok)
            if d != tok:
                break
        st.sampled.extend(out)
        return out


class _Tap(asyncio.Queue):
    """A queue whose put_nowait shows each message to `hook` first."""

    def __init__(self, hook):
        super().__init__()
        self.hook = hook

    def put_nowait(self, msg) -> None:
        self.hook(msg)
        super().put_nowait(msg)


def _check(ok, message: str) -> None:
    if not ok:
        raise HarnessError(message)


class EngineHarness:
    def __init__(self, setup: Setup, arrivals: list[Arrival], max_steps: int | None = None,
                 timeout: float = 30.0, tolerate: frozenset[str] = KNOWN_BUGS):
        self.setup = setup
        self.tolerate = tolerate
        self.arrivals = list(arrivals)
        self.max_steps = max_steps if max_steps is not None else liveness_bound(arrivals)
        self.timeout = timeout
        for i, a in enumerate(self.arrivals):
            if a.sibling_of is not None:
                lead = self.arrivals[a.sibling_of]
                assert a.sibling_of < i and lead.prompt == a.prompt \
                    and lead.iteration == a.iteration, f"arrival {i}: not a sibling"
        self.prompts = {request_id(i): a.prompt for i, a in enumerate(self.arrivals)}
        self.future = deque(sorted(range(len(self.arrivals)),
                                   key=lambda i: (self.arrivals[i].iteration, i)))
        self.abort_after = {request_id(i): a.abort_after for i, a in enumerate(self.arrivals)
                            if a.abort_after is not None}
        self.abort_delay = {request_id(i): a.abort_delay for i, a in enumerate(self.arrivals)
                            if a.abort_delay is not None}
        self.aborts_sent: set[str] = set()
        self.num_nudges = 0   # known stalls (KNOWN_BUGS): times the harness woke it up
        self._outbox: deque = deque()   # arrivals and aborts on their way (event_lag)
        self.added_at: dict[str, int] = {}     # request -> iteration it was added
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.finished: dict[str, RequestOutput] = {}
        self.finished_at_last_send: frozenset[str] = frozenset()
        self.failure: BaseException | None = None
        self.kv_stats: KVStats | None = None
        self.integrity: str | None = "not checked"
        self.loop: asyncio.AbstractEventLoop | None = None
        self.logs: list[dict] = []
        self.kv_log: list[str] = []   # plan / update / reply, in order (check_kv_round_trips)

    # -- the engine, wired as Engine.__init__ wires it -------------------------------------
    def _build(self) -> None:
        s, lim = self.setup, self.setup.limits
        capacity = lim.num_blocks * lim.block_size
        swap = SwapSpace(s.swap_slots) if s.swap_slots else None
        self.tiers = None
        if s.tier_blocks and s.prefix_caching:
            self.tiers = _host_tier(lim.block_size, s.tier_blocks, s.tier_fail)
        core = Scheduler(
            lim, (EOS,), s.max_model_len or capacity, self._emit,
            PrefixTracker("fake-model", lim.block_size, s.prefix_caching), config=s.config,
            swap=swap, block_bytes=s.block_bytes,
            spec=SpecController("ngram", s.spec_k, mode="on") if s.spec_k else None,
            tiers=self.tiers)
        # The KV manager's inbox and replies go through taps: every message between the
        # scheduler and the KV manager is logged (one each way per step, `check`), and the
        # swap-outs each grant resolves are noted (to check that every one reaches the
        # runner).
        scheduler_inbox: asyncio.Queue = asyncio.Queue()
        replies = _Tap(self._on_kv_reply)
        groups = s.kv_groups
        self.kv = KVManagerActor(KVCacheManager(lim.num_blocks + bool(groups and groups.hybrid),
                                                lim.block_size,
                                                enable_prefix_caching=s.prefix_caching,
                                                groups=groups),
                                 replies=replies, scheduler_inbox=scheduler_inbox,
                                 tiers=self.tiers)
        self.kv.inbox = _Tap(self._on_kv_update)
        self.runner = FakeRunner(self)
        self.scheduler = SchedulerActor(core, inbox=scheduler_inbox, kv_inbox=self.kv.inbox,
                                        kv_replies=replies, runner=self.runner)
        plan = core.plan

        def logged_plan():
            self.kv_log.append("plan")
            return plan()
        core.plan = logged_plan

    def _on_kv_update(self, msg) -> None:
        if isinstance(msg, KVUpdate):
            self.kv_log.append("update")

    def _on_kv_reply(self, msg) -> None:
        self.kv_log.append("reply")
        if isinstance(msg, KVGrant) and msg.swap_out:
            self.runner.granted_swap_outs.append(list(msg.swap_out))

    def check_kv_round_trips(self) -> None:
        """One message each way per step: every plan is followed by exactly one update and
        its one reply before anything else reaches the KV manager; the only other updates
        are idle ones (returning blocks with nothing planned), each with its reply."""
        log = self.kv_log
        i = 0
        while i < len(log):
            if log[i] == "plan":
                assert log[i + 1:i + 3] == ["update", "reply"], (i, log[i:i + 6])
                i += 3
            else:
                assert log[i:i + 2] == ["update", "reply"], (i, log[i:i + 6])
                i += 2

    # -- scenario events -----------------------------------------------------------------
    def _emit(self, out: RequestOutput) -> None:
        rid = out.request_id
        if rid in self.finished:
            self.fail(HarnessError(f"{rid}: an output after its final one: {out}"))
            return
        self.outputs.setdefault(rid, []).append(out)
        if out.finished:
            self.finished[rid] = out
            self._progress.set()

    def _add(self, i: int) -> None:
        a = self.arrivals[i]
        rid = request_id(i)
        self.added_at[rid] = self.runner.executed
        self._deliver(AddRequest(
            request_id=rid, prompt_token_ids=list(a.prompt),
            sampling_params=SamplingParams(max_tokens=a.max_tokens, ignore_eos=True),
            arrival_time=time.monotonic(), meta=RequestMeta(
                cache_salt=a.cache_salt, priority=a.priority, tenant=a.tenant,
                group_id=None if a.sibling_of is None else request_id(a.sibling_of))))

    def _add_due(self) -> None:
        while self.future and self.arrivals[self.future[0]].iteration <= self.runner.executed:
            self._add(self.future.popleft())

    def _add_next_group(self) -> None:
        """The engine is idle: the next arrivals come now."""
        due = self.arrivals[self.future[0]].iteration
        while self.future and self.arrivals[self.future[0]].iteration == due:
            self._add(self.future.popleft())

    def before_output(self, batch: ExecuteBatch) -> None:
        """Called by the fake runner after executing `batch`, before posting its output."""
        if self.runner.executed > self.max_steps:
            self.fail(HarnessError(f"no completion after {self.max_steps} steps: livelock? "
                                   f"{self.describe()}"))
            return
        for s in batch.sequences:
            rid = s.request_id
            after = self.abort_after.get(rid)
            if after is not None and len(self.runner.sampled.get(rid, ())) >= after:
                self._abort(rid)
        for rid, delay in self.abort_delay.items():
            if rid in self.added_at and self.runner.executed >= self.added_at[rid] + delay:
                self._abort(rid)
        self._add_due()

    def _abort(self, rid: str) -> None:
        if rid not in self.aborts_sent:
            self.aborts_sent.add(rid)
            self._deliver(AbortRequest(request_id=rid))

    def _deliver(self, msg) -> None:
        hops = self.setup.event_lag
        if not hops:
            self.scheduler.send(msg)
            return
        self._outbox.append(msg)
        self._hop(hops)

    def _hop(self, hops: int) -> None:
        if hops:
            self.loop.call_soon(self._hop, hops - 1)
        else:   # one message per chain, in the order they were sent
            self.scheduler.send(self._outbox.popleft())

    def tolerated_leaks(self) -> set[str]:
        if "preempted-abort-leak" not in self.tolerate:
            return set()
        return {rid for rid, out in self.finished.items() if out.finish_reason == "abort"
                and out.timings is not None and out.timings.num_preemptions}

    def fail(self, e: BaseException) -> None:
        if self.failure is None:
            self.failure = e
        self._progress.set()

    # -- driving -------------------------------------------------------------------------
    async def _ask(self, actor, query):
        query.reply = asyncio.get_running_loop().create_future()
        actor.send(query)
        return await query.reply

    def _raise_if_failed(self, tasks) -> None:
        if self.failure is not None:
            raise self.failure
        for t in tasks:
            if t.done():
                exc = t.exception() if not t.cancelled() else None
                raise HarnessError(f"the {t.get_name()} actor stopped: {exc!r}") from exc

    def _unless_stalled(self, task: asyncio.Task) -> None:
        """Fail if the scheduler is stuck: blocked on its empty inbox with requests
        waiting, nothing running or in flight, and no message on its way to any actor
        (nothing will ever wake it). Deterministic: the poll only decides when to look."""
        s, core = self.scheduler, self.scheduler.core
        if not core.waiting or core.running or s.in_flight or not s.inbox.empty() \
                or not self.kv.inbox.empty() or self.runner.queue or self._outbox \
                or not s.inbox._getters:   # (it is not blocked on its inbox)
            return
        where, coro = [], task.get_coro()
        while coro is not None and hasattr(coro, "cr_code"):
            where.append(coro.cr_code.co_name)
            coro = coro.cr_await
        known = (where[:2] == ["run", "_receive"] and "idle-arrival-stall" in self.tolerate
                 or where[:3] == ["run", "step", "_schedule"] and core.view.has_pending_frees
                 and "abort-stall" in self.tolerate)
        if known:
            self.num_nudges += 1
            self.scheduler.send(IsIdle(reply=self.loop.create_future()))  # any message wakes it
            return
        self.fail(HarnessError(f"the scheduler is stuck in {' -> '.join(where)} with requests "
                               f"waiting and nothing on its way: {self.describe()}"))

    async def _until_idle(self, tasks) -> None:
        while not await self._ask(self.scheduler, IsIdle()):
            self._raise_if_failed(tasks)
            await asyncio.sleep(0)
        self._raise_if_failed(tasks)

    async def _drive(self, tasks) -> None:
        self._add_due()
        while True:
            self._raise_if_failed(tasks)
            if len(self.finished) == len(self.added_at):
                if not self.future:
                    break
                await self._until_idle(tasks)
                if self.future and len(self.finished) == len(self.added_at):
                    self._add_next_group()   # (steps run meanwhile may have added them)
                continue
            self._progress.clear()
            waiter = asyncio.ensure_future(self._progress.wait())
            done, _ = await asyncio.wait({waiter, *tasks}, timeout=0.05,
                                         return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if not done:
                self._unless_stalled(tasks[0])
        # Everything finished: the idle loop's KV update returns the last blocks.
        await self._until_idle(tasks)
        for _ in range(1000):
            self.kv_stats = await self._ask(self.kv, GetKVStats())
            if self.kv_stats.used == 0:
                break
            await asyncio.sleep(0)
        self.integrity = await self._ask(self.kv, CheckIntegrity())
        self._raise_if_failed(tasks)

    async def main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._progress = asyncio.Event()
        self._build()
        sched = asyncio.create_task(self.scheduler.run(), name="scheduler")
        kv = asyncio.create_task(self.kv.run(), name="kv_manager")
        tasks = (sched, kv)
        try:
            try:
                await asyncio.wait_for(self._drive(tasks), self.timeout)
            except TimeoutError:
                raise HarnessError(f"no progress within {self.timeout} s: deadlock? "
                                   f"{self.describe()}") from None
            # A clean shutdown, as Engine.shutdown does it: scheduler first, then the KV manager.
            self.scheduler.send(Shutdown())
            await asyncio.wait_for(sched, 5)
            self.kv.send(Shutdown())
            await asyncio.wait_for(kv, 5)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def describe(self) -> str:
        s = self.scheduler.core
        return (f"step {self.runner.executed}; waiting={list(s.waiting)} running={s.running} "
                f"in_flight={[f.batch.step for f in self.scheduler.in_flight]} "
                f"finished={sorted(self.finished)} "
                f"not yet added={[request_id(i) for i in self.future]}")

    # -- results -------------------------------------------------------------------------
    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, ()) for t in o.new_token_ids]

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.core.preemptor.num_preemptions

    @property
    def num_swap_preemptions(self) -> int:
        return self.scheduler.core.preemptor.num_swap_preemptions

    def check(self) -> None:
        """The end state every scenario must reach (see the module docstring)."""
        for i, a in enumerate(self.arrivals):
            rid = request_id(i)
            final = self.finished.get(rid)
            assert final is not None, f"{rid} never finished"
            assert all(not o.finished for o in self.outputs[rid][:-1])
            tokens, sampled = self.tokens(rid), self.runner.sampled.get(rid, [])
            if a.abort_after is not None and not self.setup.event_lag:
                # The abort overtook the output carrying token number abort_after.
                assert final.finish_reason == "abort", f"{rid}: {final}"
                assert len(tokens) <= max(0, a.abort_after - 1), (rid, tokens, a)
            if final.finish_reason == "abort":
                assert a.abort_after is not None or a.abort_delay is not None, f"{rid}: {final}"
                assert len(tokens) < a.max_tokens, (rid, tokens, a)
                assert tokens == sampled[:len(tokens)], f"{rid}: {tokens} vs {sampled}"
            else:
                assert final.finish_reason == "length" and final.error is None, f"{rid}: {final}"
                assert len(tokens) == a.max_tokens, f"{rid}: {len(tokens)} tokens, {a}"
                # ... exactly those the runner sampled: none lost, none sampled in vain.
                assert tokens == sampled, f"{rid}: emitted {tokens}, sampled {sampled}"
        sched = self.scheduler.core
        # With sliding windows a decode may wait one step for the blocks its own windows
        # drop (policy.py, `drops_pending`): reported free only by the next update.
        groups = self.setup.kv_groups
        bound = 1 if groups is not None and groups.hybrid else 0
        assert sched.observer.max_decode_skip <= bound, sched.observer.max_decode_skip
        assert not sched.requests and not sched.waiting and not sched.running \
            and not self.scheduler.in_flight, self.describe()
        if sched.preemptor.swap is not None:
            assert sched.preemptor.swap.num_free == self.setup.swap_slots, "swap slots leaked"
        assert self.integrity is None, self.integrity
        self.check_kv_round_trips()
        assert self.kv_stats is not None and self.kv_stats.used == 0, self.kv_stats
        assert self.kv_stats.free == self.setup.limits.num_blocks, self.kv_stats
        # Runner state: every finished request is gone (named by a batch's finished_ids, or
        # by the ForgetRequests the scheduler sends when it goes idle).
        leaked = self.runner.seqs.keys() & self.finished_at_last_send - self.tolerated_leaks()
        assert not leaked, f"the runner still holds finished requests {sorted(leaked)}"
        assert self.runner.max_queued <= (2 if self.setup.config.overlap else 1), \
            (self.runner.max_queued, self.setup)
        if not self.setup.config.overlap:
            assert self.runner.num_placeholders == 0


def run_scenario(setup: Setup, arrivals: list[Arrival], *, check: bool = True,
                 max_steps: int | None = None, timeout: float = 30.0,
                 tolerate: frozenset[str] = KNOWN_BUGS) -> EngineHarness:
    """Run the arrivals through the engine core to completion; check the end state."""
    h = EngineHarness(setup, arrivals, max_steps=max_steps, timeout=timeout, tolerate=tolerate)
    with capture_logs() as h.logs:   # quiet, and kept for assertions
        asyncio.run(h.main())
    if check:
        h.check()
    return h
