"""A client that drives two daemons the way llm-d's routing sidecar (connector "nixlv2")
does, written from its published Go source (internal/proxy/connector_nixlv2.go), for tests
and benchmarks: the decode pod's sidecar, given the prefill pod by `x-prefiller-host-port`.

1. prefill: the same body with `kv_transfer_params` = {do_remote_decode: true,
   do_remote_prefill: false, remote_engine_id/block_ids/host/port: null}, `stream: false`,
   no `stream_options`, `max_tokens: 1`, and an `x-request-id` header (a fresh uuid);
2. decode: the original body (its stream, stream_options and max_tokens restored) with
   the prefill answer's `kv_transfer_params`, same `x-request-id`, to the local decoder;
3. a prefill that fails (no answer, or a 5xx) falls back to the decoder with the original
   body (a local prefill), as the sidecar's later versions do.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid


def _post(url: str, path: str, body: dict, headers: dict, timeout: float):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def pd_request(decode_url: str, prefill_host_port: str, path: str, body: dict,
               timeout: float = 120.0) -> tuple[int, bytes, dict]:
    """(decode status, decode body bytes, what happened: {"prefill_status", "fallback",
    "kv_transfer_params"})."""
    rid = str(uuid.uuid4())
    headers = {"x-request-id": rid}
    pre = dict(body)
    pre["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                 "remote_engine_id": None, "remote_block_ids": None,
                                 "remote_host": None, "remote_port": None}
    pre["stream"] = False
    pre.pop("stream_options", None)
    pre["max_tokens"] = 1
    info: dict = {"prefill_status": None, "fallback": False, "kv_transfer_params": None}
    try:
        status, raw = _post(f"http://{prefill_host_port}", path, pre, headers, timeout)
    except OSError:
        status, raw = None, b""
    info["prefill_status"] = status
    info["prefill_body"] = raw[:2000]
    dbody = dict(body)
    if status is None or status >= 500:
        info["fallback"] = True          # a local prefill on the decoder
    elif not 200 <= status < 300:
        return status, raw, info
    else:
        params = json.loads(raw).get("kv_transfer_params")
        info["kv_transfer_params"] = params
        dbody["kv_transfer_params"] = params
    status, raw = _post(decode_url, path, dbody, headers, timeout)
    return status, raw, info
