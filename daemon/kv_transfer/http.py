"""`kv_transfer_params` on the generation endpoints (llm-d's prefill/decode protocol).

`prepare` runs before the request is submitted: a `do_remote_decode` request is marked for
export (RequestMeta.kv_export: its prompt KV goes to the handoff tier); a
`do_remote_prefill` one first pulls the named blocks (service.py). `finish` adds the
`kv_transfer_params` a decode daemon needs to the prefill's JSON answer; `release` frees
what a decode pulled once its request is over.
"""

from __future__ import annotations

import dataclasses

import msgspec

from tokenloom.actors.kv.block_hash import CacheIdentity, hash_request_blocks
from tokenloom.daemon.errors import APIError
from tokenloom.daemon.openai.protocol import ParsedRequest

PARAM = "kv_transfer_params"


async def prepare(state, parsed: ParsedRequest, request_id: str, num_prompts: int
                  ) -> ParsedRequest:
    kv = parsed.kv_transfer
    if kv is None:
        return parsed
    service = state.kv_transfer
    if service is None:
        raise APIError(400, "kv_transfer_params needs a daemon started with kv_transfer.port "
                            "set (docs/disaggregation.md)", param=PARAM)
    remote_decode = bool(kv.get("do_remote_decode"))
    remote_prefill = bool(kv.get("do_remote_prefill"))
    if remote_decode and remote_prefill:
        raise APIError(400, "kv_transfer_params: do_remote_decode and do_remote_prefill "
                            "cannot both be true", param=PARAM)
    if remote_decode:
        if parsed.stream or parsed.params.n != 1 or num_prompts != 1:
            raise APIError(400, "kv_transfer_params.do_remote_decode needs one prompt, n = 1 "
                                "and stream false (the prefill's answer carries the "
                                "parameters for the decode daemon)", param=PARAM)
        return dataclasses.replace(
            parsed, meta=msgspec.structs.replace(parsed.meta, kv_export=True))
    if remote_prefill:
        await service.pull(request_id, kv)
    return parsed


async def finish(state, parsed: ParsedRequest, gen, body: dict) -> None:
    kv = parsed.kv_transfer
    if kv is None or not kv.get("do_remote_decode") or state.kv_transfer is None:
        return
    choice = gen.results()[0]
    ids = choice.exported_prompt or []
    info = state.engine.info
    ident = CacheIdentity(model_fingerprint=info.fingerprint, cache_salt=parsed.meta.cache_salt,
                          adapter=parsed.meta.lora).encode()
    reusable = max(0, (len(ids) - 1) // info.block_size)   # the decode side recomputes the rest
    hashes = hash_request_blocks(ids, info.block_size, ident)[:reusable]
    body[PARAM] = await state.kv_transfer.export(gen.request_id, hashes)


def release(state, parsed: ParsedRequest, request_id: str) -> None:
    kv = parsed.kv_transfer
    if kv is not None and kv.get("do_remote_prefill") and state.kv_transfer is not None:
        state.kv_transfer.release(request_id)
