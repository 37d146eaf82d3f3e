"""Constrained (guided) decoding with xgrammar: compile a request's constraint once, keep a
matcher per request, and mask the logits of the rows that carry one.

Why xgrammar: it installs as one manylinux wheel next to the pinned CPU torch, and with
SmolLM2's 49,152-token vocabulary it fills a next-token mask in ~7 us per token on average
(JSON schema, this machine; see benchmarks/structured.py), with a C++ kernel that applies
the mask to chosen rows of a CPU logits tensor in place.

Contract:
- `GuidedCompiler.compile(guided)` returns an xgrammar CompiledGrammar or raises
  `GuidedError` naming the request field at fault. Thread-safe; results are cached by
  (kind, spec), so the tokenizer actor's worker thread compiles (and validates) a request
  off the event loop, and the runner's later call for the same constraint is a cache hit.
- `GuidedMatcher` tracks one request's position in its grammar: `accept(token)` advances it
  (False: the token is not allowed, the request must end), `fill(bitmask, row)` writes the
  allowed-next-token bits. `replay(tokens)` brings a fresh matcher to a request's output so
  far (a request registered after preemption, or forked).
- The grammar's end allows only the engine's EOS tokens, so a finished constraint ends the
  request with finish_reason "stop".
"""

from __future__ import annotations

import collections
import json
import re
import threading

import torch

from tokenloom.actors.sampling_params import GuidedDecoding

# Compiled grammars kept (each holds a per-token mask cache: tens to hundreds of KB).
CACHE_SIZE = 256
_ENGINE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GuidedError(ValueError):
    """A constraint that cannot be compiled; `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _engine_message(e: Exception) -> str:
    # xgrammar's C++ errors read "[03:20:34] /project/cpp/x.cc:94: Regex parsing error ...".
    return _ENGINE_PREFIX.sub("", str(e).strip())


def _choice_grammar(choices: list[str]) -> str:
    # JSON string literals are valid EBNF literals (same escapes).
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GuidedCompiler:
    """Built by the engine for every model; xgrammar's tokenizer tables (~0.1 s for a 49k
    vocabulary) are made on the first compile, so engines that never see a constraint pay
    nothing."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = list(stop_token_ids)
        self._xgr_compiler = None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def _compiler(self):
        with self._lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids)
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                         cache_enabled=False)
            return self._xgr_compiler

    def compile(self, guided: GuidedDecoding):
        key = (guided.kind, guided.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(guided)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, guided: GuidedDecoding):
        c, kind, spec = self._compiler, guided.kind, guided.spec
        param = FIELD_OF_KIND[kind]
        try:
            if kind == "json_object":
                return c.compile_builtin_json_grammar()
            if kind == "json_schema":
                grammar = c.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
            elif kind == "regex":
                grammar = c.compile_regex(spec)
            elif kind == "choice":
                grammar = c.compile_grammar(_choice_grammar(json.loads(spec)))
            else:  # "grammar": EBNF (GBNF-style, xgrammar's dialect), root rule `root`
                grammar = c.compile_grammar(spec)
        except Exception as e:  # noqa: BLE001 - the engine's parse errors are the user's
            raise GuidedError(f"{param} is not a valid {_KIND_NAMES[kind]}: "
                              f"{_engine_message(e)}", param) from None
        if _matches_nothing(grammar, self.vocab_size):
            raise GuidedError(f"{param} cannot match any text", param)
        return grammar


# The OpenAI/vLLM request field each kind comes from, for error messages.
FIELD_OF_KIND = {"json_object": "response_format", "json_schema": "response_format.json_schema",
                 "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
_KIND_NAMES = {"json_schema": "JSON schema", "regex": "regular expression",
               "choice": "list of choices", "grammar": "EBNF grammar"}


def _matches_nothing(compiled, vocab_size: int) -> bool:
    """Whether no token (not even EOS, i.e. an empty match) can start this grammar."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    return not bool(mask.any())


class GuidedMatcher:
    """One request's grammar state (see the module docstring)."""

    def __init__(self, compiled):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0
        self.error: str | None = None

    @property
    def terminated(self) -> bool:
        """The grammar accepted EOS: the request has ended (EOS always ends a guided
        request), though a step planned before its end may still sample it."""
        return self._matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        if self._matcher.is_terminated():
            ok = False
        else:
            ok = self._matcher.accept_token(token_id)
        if ok:
            self.num_accepted += 1
        return ok

    def replay(self, token_ids) -> bool:
        return all(self.accept(t) for t in token_ids)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    import xgrammar as xgr
    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Disallowed tokens of `rows` become -inf in `logits` [B, V] (float32, in place);
    `bitmask` [B, ceil(V / 32)] int32 has those rows filled."""
    import xgrammar as xgr
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
