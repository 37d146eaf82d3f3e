"""The tokenizer actor: text or chat messages -> prompt token ids -> the router.

Validation that needs the tokens (empty prompt, prompt + max_tokens beyond the context
window) happens here, so a bad request ends with an error output before it costs anything.

Encoding runs off the event loop, on one worker thread the actor owns: a 200 KB prompt
takes ~60 ms to encode (SmolLM2's BPE) and would otherwise stall every stream the loop
serves. HF fast tokenizers release the GIL while encoding. Cheap requests are tokenized
inline, where the thread round trip would cost the loop more than the work (see
`INLINE_MAX_CHARS`).

Ordering contract: messages leave the actor in the order they arrived in its inbox. Each
inbox message becomes one entry of a FIFO: a ready outcome (a pass-through message such as
an AbortRequest, or a request tokenized inline) or a future of one (a request on the worker
thread). Outcomes are released strictly from the head, as soon as the head is ready: an
AddRequest goes to `next_inbox`, a rejection goes to `emit`. So an abort is forwarded only
after its request's AddRequest (or after its rejection was emitted), and a small request
behind a big one waits for it (FIFO, no overtaking) — but the loop itself never waits.

Shutdown is ordered like any message: everything that arrived before it is finished and
released in order, then the worker thread stops; messages after it are not read. If the
actor is cancelled instead, pending work is dropped and the worker is shut down.
"""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from tokenloom.actors.base import Actor
from tokenloom.actors.front.prompts import PromptError, encode_prompt, fit_prompt
from tokenloom.actors.messages import (
    ERROR_INVALID,
    AddRequest,
    GenerateRequest,
    RequestOutput,
    Shutdown,
)

# Measured with SmolLM2's tokenizer on 2 CPU cores: a hop to the worker thread costs the
# loop ~20 us of CPU (~30 us of added latency), whatever the prompt size; encoding inline
# costs the loop ~10 us + ~0.26 us per character (2,000 chars ~0.5 ms, 200 KB ~60 ms).
# Inline therefore pays only for short prompts: at 256 chars it costs the loop at most
# ~3 hops and saves the round trip. Validating token ids inline costs ~0.02 us per id.
# A chat template is never inline: rendering even a one-line chat (Jinja) costs ~100 us.
INLINE_MAX_CHARS = 256
INLINE_MAX_IDS = 2048


class TokenizerActor(Actor):
    """See the module docstring for the ordering contract. The tokenizer object is shared
    by the loop thread (inline requests) and the one worker thread; concurrent encodes are
    safe with HF fast tokenizers as long as nobody changes truncation or padding, which
    this actor never does."""

    name = "tokenizer"

    def __init__(self, tokenizer, max_model_len: int, emit: Callable[[RequestOutput], None],
                 next_inbox: asyncio.Queue, guided=None,
                 max_prompt_logprobs_tokens: int | None = None):
        """`next_inbox`: the router's."""
        super().__init__()
        self.tokenizer = tokenizer
        # Compiles (and so validates) guided-decoding constraints, on the worker thread;
        # its cache hands the runner the compiled grammar (actors/execution/guided.py).
        self.guided = guided
        self.max_model_len = max_model_len
        self.max_prompt_logprobs_tokens = max_prompt_logprobs_tokens   # None: unbounded
        self.emit = emit
        self.next_inbox = next_inbox
        # Inbox order: each entry is an outcome to release, or a future of one.
        self._pending: collections.deque[Any] = collections.deque()
        self._executor: ThreadPoolExecutor | None = None

    # -- pure work (any thread) ------------------------------------------------------------
    def encode(self, req: GenerateRequest) -> list[int]:
        return encode_prompt(self.tokenizer, req)

    def check(self, req: GenerateRequest, ids: list[int]):
        """The sampling params to use (see prompts.fit_prompt)."""
        return fit_prompt(req, ids, self.max_model_len, self.max_prompt_logprobs_tokens)

    def prepare(self, req: GenerateRequest) -> AddRequest | RequestOutput:
        """Tokenize and validate one request: its AddRequest, or its error output (a bad
        request ends only itself). Never raises; touches no actor state but the tokenizer,
        so it may run on the worker thread."""
        try:
            ids = self.encode(req)
            params = self.check(req, ids)
            if params.guided is not None:
                if self.guided is None:
                    raise PromptError("guided decoding is not available in this engine",
                                      "guided")
                self.guided.compile(params.guided)   # GuidedError names the field
            return AddRequest(
                request_id=req.request_id, prompt_token_ids=ids, sampling_params=params,
                arrival_time=req.arrival_time or time.monotonic(), meta=req.meta,
                tokenized_time=time.monotonic())
        except Exception as e:
            return RequestOutput(request_id=req.request_id, new_token_ids=[], finished=True,
                                 finish_reason="error", error=str(e), error_kind=ERROR_INVALID,
                                 error_param=getattr(e, "param", None))

    @staticmethod
    def is_cheap(req: GenerateRequest) -> bool:
        """Whether `req` is tokenized inline rather than on the worker thread."""
        if req.sampling_params.guided is not None:
            return False   # compiling a grammar takes milliseconds: never on the loop
        if req.prompt_token_ids is not None:
            return len(req.prompt_token_ids) <= INLINE_MAX_IDS
        if req.messages is not None:
            return False
        return len(req.prompt or "") <= INLINE_MAX_CHARS

    # -- the ordered pipeline (loop thread only) -----------------------------------------
    def _accept(self, msg: Any) -> None:
        """Append `msg`'s outcome behind everything that arrived before it."""
        if isinstance(msg, GenerateRequest):
            if self.is_cheap(msg):
                entry = self.prepare(msg)
            else:
                entry = asyncio.get_running_loop().run_in_executor(self._executor, self.prepare,
                                                                   msg)
                entry.add_done_callback(self._release)
        else:
            entry = msg  # aborts etc. keep their order with adds
        self._pending.append(entry)
        self._release()

    def _release(self, _done: asyncio.Future | None = None) -> None:
        """Release the ready prefix of the FIFO, in order."""
        pending = self._pending
        while pending:
            head = pending[0]
            if isinstance(head, asyncio.Future):
                if not head.done():
                    return
                head = head.result()  # prepare() never raises; a cancelled one left the FIFO
            pending.popleft()
            self._forward(head)

    def _forward(self, outcome: Any) -> None:
        if isinstance(outcome, RequestOutput):
            self.log.info("request rejected", request_id=outcome.request_id, error=outcome.error)
            self.emit(outcome)
        else:
            self.next_inbox.put_nowait(outcome)

    async def _finish_pending(self) -> None:
        futures = [e for e in self._pending if isinstance(e, asyncio.Future)]
        if futures:
            await asyncio.wait(futures)
        self._release()

    async def run(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenloom-tokenizer")
        try:
            while True:
                msg = await self.inbox.get()
                match msg:
                    case Shutdown():
                        await self._finish_pending()
                        return
                    case _:
                        self._accept(msg)
        finally:
            # Only non-empty when cancelled: drop the work (cancelled futures release nothing).
            for entry in self._pending:
                if isinstance(entry, asyncio.Future):
                    entry.cancel()
            self._pending.clear()
            self._executor.shutdown(wait=False, cancel_futures=True)
