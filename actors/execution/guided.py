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
- Speculative decoding: `fill_drafts(bitmask, row, drafts)` writes one mask per
  verification row (row j: the state after drafts 0..j-1) and `legal_prefix(drafts)` says
  how many of a proposal the grammar allows. Both advance the matcher through the drafts
  and roll it back before returning, so the matcher only ever follows the request's
  output: the runner accepts the verified tokens afterwards as it accepts any sampled
  token (a preempted request has nothing speculative to undo).
- The grammar's end allows only the engine's EOS tokens, so a finished constraint ends the
  request with finish_reason "stop".
- A constraint with a reasoning gate (GuidedDecoding.gate) applies to the answer after the
  model's thinking: while the output thinks, every token is allowed and none reaches the
  grammar; the end tag's token starts it. Where the output may open its thinking itself,
  the first token may be the start tag beside whatever the grammar allows. Drafts are
  verified only once the grammar has started (until then a proposal is cut to nothing).
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


# Where a gated matcher is (GuidedDecoding.gate): thinking (every token allowed), at its
# first token (the grammar's tokens or the start tag), or in the grammar.
_THINKING, _FIRST, _GRAMMAR = 0, 1, 2


def _set_bit(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    value = 1 << bit
    bitmask[row, word] |= value - (1 << 32) if value >= 1 << 31 else value   # int32 words


class GuidedMatcher:
    """One request's grammar state (see the module docstring). `gate`: the request's
    sampling_params.guided.gate (None: the grammar applies from the first token)."""

    def __init__(self, compiled, gate=None):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0
        self.error: str | None = None
        self._gate = gate
        if gate is None:
            self._phase = _GRAMMAR
        elif gate.opened:
            self._phase = _THINKING
        else:
            self._phase = _FIRST if gate.start_token_id >= 0 else _GRAMMAR

    @property
    def terminated(self) -> bool:
        """The grammar accepted EOS: the request has ended (EOS always ends a guided
        request), though a step planned before its end may still sample it."""
        return self._phase == _GRAMMAR and self._matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        if self._phase == _FIRST:
            self._phase = _GRAMMAR
            if token_id == self._gate.start_token_id:
                self._phase = _THINKING
                self.num_accepted += 1
                return True
        if self._phase == _THINKING:
            if token_id == self._gate.end_token_id:
                self._phase = _GRAMMAR
            self.num_accepted += 1
            return True
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
        if self._phase == _THINKING:
            bitmask[row] = -1
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._phase == _FIRST:
            _set_bit(bitmask, row, self._gate.start_token_id)

    def legal_prefix(self, drafts) -> int:
        """How many leading drafts the grammar allows, stopping before one that ends it
        (EOS is left to the sampler: nothing follows it to verify). The rest would be
        rejected for certain, so they are not worth verifying. The matcher is left as it
        was."""
        if self.error is not None or self._phase != _GRAMMAR:
            return 0
        n = 0
        for d in drafts:
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(d)):
                break
            if self._matcher.is_terminated():
                self._matcher.rollback(1)
                break
            n += 1
        if n:
            self._matcher.rollback(n)
        return n

    def fill_drafts(self, bitmask: torch.Tensor, row: int, drafts) -> int | None:
        """Masks for a speculative verification: bitmask row `row + j` is the allowed-next
        set after drafts[:j]. A draft the grammar refuses truncates the proposal there, so
        `kept` drafts are verified, over rows row..row+kept. Returns kept, or None when the
        grammar allows nothing at all (row `row` empty: no legal token). The matcher is
        left as it was."""
        if self.error is not None or self.terminated:
            return None
        if self._phase != _GRAMMAR:   # thinking, or its first token: no drafts verified
            self.fill(bitmask, row)
            return 0
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if not bool(bitmask[row].any()):
            return None
        kept = 0
        for d in drafts:
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(d)):
                break
            if self._matcher.is_terminated():   # EOS drafted: left to the sampler
                self._matcher.rollback(1)
                break
            self._matcher.fill_next_token_bitmask(bitmask, row + kept + 1)
            if not bool(bitmask[row + kept + 1].any()):   # a dead end: not a prefix
                self._matcher.rollback(1)
                break
            kept += 1
        if kept:
            self._matcher.rollback(kept)
        return kept


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    import xgrammar as xgr
    return xgr.allocate_token_bitmask(rows, vocab_size)


def restrict_draft_probs(probs: torch.Tensor, bitmask: torch.Tensor, row: int,
                         kept: int) -> torch.Tensor:
    """A draft model's distributions q_0..q_{kept-1} [kept, V] (of a proposal cut to its
    `kept` legal drafts by `fill_drafts`), each restricted to what the grammar allows at
    its verification row (`bitmask` rows row..row+kept-1) and renormalised.

    Why: the drafts that get verified are the ones the grammar allows, so each is drawn
    from q_j conditioned on being allowed, which is this q'_j; verified with q'_j, the
    rejection rule's output is distributed as the masked target row. (Verified with q_j,
    its residual max(p - q_j, 0) would also correct for the refused drafts that were cut
    before verification, and the output would be skewed.)"""
    logq = probs[:kept].float().log()
    apply_bitmask(logq, bitmask[row:row + kept].to(logq.device), list(range(kept)))
    return logq.softmax(-1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Disallowed tokens of `rows` become -inf in `logits` [B, V] (float32, in place);
    `bitmask` [B, ceil(V / 32)] int32 has those rows filled."""
    import xgrammar as xgr
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
