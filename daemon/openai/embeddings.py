"""POST /v1/embeddings (served with `tokenloom serve --embeddings`, server.embeddings): the
served decoder model as an embedder, beside generation, as llama-server's --embeddings.

Each input becomes one engine request that computes its prompt and nothing more
(SamplingParams.pooling, max_tokens 1: the one sampled token is dropped), scheduled with
every other request by the same scheduler, so a batch of inputs is prefilled together with
whatever else runs. The runner pools the prompt's final-normed hidden states as the model's
pooling config says (pooling_config.py; actors/execution/pooling.py) and hands the vector
to the request's stream ahead of its finished output. Last-token pooling shares the prefix
cache like any request (a repeated prefix is not recomputed); mean and CLS pooling need
every position computed, so those requests get a cache salt of their own. The request's KV
blocks are freed when it finishes (left to the prefix cache as any request's).

The response is OpenAI's: `data[i].embedding` a list of floats, or with `encoding_format`
"base64" the little-endian float32 bytes in base64; `dimensions` cuts the vector (then
renormalized) where the model was trained for it (Matryoshka), else is a 400 naming it.
`usage.prompt_tokens` counts every input's tokens.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from tokenloom.actors.messages import GenerateRequest, PooledOutput, RequestOutput
from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.daemon.errors import APIError
from tokenloom.daemon.openai import protocol
from tokenloom.daemon.openai.endpoints import check_serving, read_body, struct_response
from tokenloom.daemon.openai.generation import _engine_error
from tokenloom.daemon.openai.prompt_inputs import completion_prompts
from tokenloom.daemon.state import STATE

MAX_INPUTS = 2048   # inputs per request (OpenAI's bound)


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    # A string, a list of strings, token ids, or a list of token-id lists (as completions'
    # prompt; checked by hand).
    input: str | list[Any]
    model: str | None = None
    encoding_format: str = "float"          # "float" | "base64"
    dimensions: int | None = None
    user: str | None = None
    # Extensions, as on the generation endpoints.
    cache_salt: str | None = None
    priority: int | str | None = None
    prompt_cache_key: str | None = None


class Embedding(msgspec.Struct, kw_only=True):
    object: str
    index: int
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    object: str
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class EmbeddingJob:
    """One HTTP request's engine requests (one per input), consumed from one queue.
    `choices` (engine request id -> input index) is what drain and admin cancel read."""

    def __init__(self, engine, request_id: str, prompts: list, params: SamplingParams,
                 meta, own_salt: bool, metrics=None):
        self.engine, self.metrics = engine, metrics
        self.request_id = request_id
        arrival = time.monotonic()
        self.requests = []
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            m = meta
            if own_salt:   # mean / CLS pooling: no prefix hit may skip a position
                m = msgspec.structs.replace(meta, cache_salt=f"{meta.cache_salt or ''}|{rid}")
            self.requests.append(GenerateRequest(
                request_id=rid, sampling_params=params, arrival_time=arrival, meta=m,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=list(prompt) if isinstance(prompt, list) else None))
        self.choices = {r.request_id: i for i, r in enumerate(self.requests)}
        self._open: set[str] = set()

    async def run(self) -> tuple[list[list[float]], int]:
        """(each input's pooled vector, the prompt tokens of all), or APIError."""
        queue: asyncio.Queue = asyncio.Queue()
        for r in self.requests:
            self.engine.submit(r, queue)
            self._open.add(r.request_id)
        vectors: list = [None] * len(self.requests)
        tokens = [0] * len(self.requests)
        while self._open:
            out = await queue.get()
            i = self.choices.get(out.request_id)
            if i is None:
                continue
            if isinstance(out, PooledOutput):
                if out.error is not None:
                    raise APIError(500, out.error)
                vectors[i] = out.data
                continue
            assert isinstance(out, RequestOutput)
            tokens[i] = out.num_prompt_tokens or tokens[i]
            if out.finished:
                self._open.discard(out.request_id)
                if out.finish_reason == "error" or (out.finish_reason == "abort"
                                                    and out.error):
                    raise _engine_error(out)
                if self.metrics is not None:
                    self.metrics.observe_finished(tokens[i], 0, out.finish_reason,
                                                  out.timings, 1)
        missing = [i for i, v in enumerate(vectors) if v is None]
        if missing:
            raise APIError(500, f"no embedding came back for input {missing[0]}")
        return vectors, sum(tokens)

    def close(self) -> bool:
        """Abort whatever is still running (the client went away, or a sibling failed)."""
        aborted = bool(self._open)
        for rid in self._open:
            self.engine.abort(rid)
            self.engine.streams.close(rid)
        self._open.clear()
        return aborted


def encode(vector: list[float], normalize: bool, dimensions: int | None,
           encoding_format: str) -> list[float] | str:
    v = np.asarray(vector, dtype=np.float32)
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = v / max(float(np.linalg.norm(v.astype(np.float64))), 1e-12)
    v = v.astype("<f4")
    if encoding_format == "base64":
        return base64.b64encode(v.tobytes()).decode("ascii")
    return v.tolist()


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_serving(state)
    req = protocol.decode(await read_body(request, state), EmbeddingRequest)
    model = protocol._check_model(req, state.limits)
    pooling = state.pooling
    if req.encoding_format not in ("float", "base64"):
        raise APIError(400, f"encoding_format must be float or base64, got "
                            f"{req.encoding_format!r}", param="encoding_format")
    if req.dimensions is not None:
        why = pooling.check_dimensions(req.dimensions)
        if why is not None:
            raise APIError(400, f"dimensions: {why}", param="dimensions")
    try:
        prompts = completion_prompts(req.input)
    except APIError as e:
        raise _renamed(e) from None
    if len(prompts) > MAX_INPUTS:
        raise APIError(400, f"input has {len(prompts)} entries; at most {MAX_INPUTS} are "
                            "allowed", param="input")
    sampling = protocol._Sampling(cache_salt=req.cache_salt, priority=req.priority,
                                  user=req.user, prompt_cache_key=req.prompt_cache_key)
    if req.cache_salt is not None and not req.cache_salt:
        raise APIError(400, "cache_salt must be a non-empty string", param="cache_salt")
    meta = protocol.request_meta(sampling, request.headers,
                                 state.config.scheduler.priority_classes)
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling.kind)
    request_id = f"embd-{uuid.uuid4().hex}"
    job = EmbeddingJob(state.engine, request_id, prompts, params, meta,
                       own_salt=pooling.kind != "last", metrics=state.metrics)
    state.inflight.add(request_id, job)   # drain waits for it; admin cancel finds it
    finished = False
    try:
        try:
            vectors, tokens = await job.run()
        except APIError as e:
            raise _renamed(e) from None
        finished = True
    finally:
        state.inflight.remove(request_id)
        if job.close() and not finished:
            state.metrics.aborted.inc()
    data = [Embedding(object="embedding", index=i,
                      embedding=encode(v, pooling.normalize, req.dimensions,
                                       req.encoding_format))
            for i, v in enumerate(vectors)]
    resp = struct_response(EmbeddingResponse(
        object="list", data=data, model=model,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)))
    resp.headers["X-Request-Id"] = request_id
    return resp


def _renamed(e: APIError) -> APIError:
    """Prompt errors name this endpoint's field: `input` (a prompt too long for the
    context window included)."""
    if e.param is not None and (e.param.startswith("prompt") or e.param == "max_tokens"):
        e.param = "input" + e.param[len("prompt"):] if e.param.startswith("prompt") \
            else "input"
        e.message = e.message.replace("prompt", "input", 1)
    return e
