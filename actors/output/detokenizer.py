"""Incremental detokenization with stop strings: token ids in, safe text deltas out.

Pure module: no torch, no asyncio. One `IncrementalDetokenizer` per request.

Technique (as in vLLM and TGI): keep a small window of token ids, `[prefix : read]` already
emitted and `[read :]` new. Each step decodes the window twice, with and without the new
tokens, and emits the difference; then the window slides forward. The cost per step is
O(window), not O(output): the window holds only the tokens since the previous emission.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer"]

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context for the first output token, so that word-boundary
# spaces come out as they would mid-text (matters for SentencePiece-style tokenizers).
PROMPT_CONTEXT_TOKENS = 5


def fast_decoder(tokenizer: Any) -> Callable[..., str]:
    """`tokenizer.decode`, or an equivalent that skips transformers' per-call Python layers
    (a third of the cost; it runs twice per streamed token): a transformers fast tokenizer
    that neither overrides decoding nor cleans up spaces decodes exactly as its Rust
    `tokenizers.Tokenizer` does. Checked once per detokenizer (~2 us)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep the public method
        return tokenizer.decode
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (isinstance(tokenizer, TokenizersBackend) and backend is not None
            and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode and not _cleans_up(tokenizer)):
        return backend.decode
    return tokenizer.decode


def _cleans_up(tokenizer: Any) -> bool:
    """Whether transformers' decode would post-process the Rust tokenizer's text."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    return not (type(tokenizer.backend_tokenizer.model).__name__ == "BPE" and not getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
        False))


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas.

    Contract:
    - `add(ids)` returns the text that became final; `finish()` returns whatever was held
      back. Their concatenation (`text`) equals `tokenizer.decode(output_ids,
      skip_special_tokens=...)`, cut before the first stop string if one matched.
    - A delta never ends in a broken character: a multi-byte character split across
      byte tokens (decoded as a trailing U+FFFD) is held until its last byte arrives.
    - Stop strings never leak: text that might be the start of a stop string is held until
      it is known not to be. On a match, `stopped` is the stop string and the delta stops
      just before it; later `add` calls return "".
    - `add(ids)` returns the same text as calling `add([i])` for each id in turn.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._decode_fn = fast_decoder(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        # An empty stop string would match before any text; it means nothing.
        self._stops = tuple(s for s in stop if s)
        self._max_stop_len = max(map(len, self._stops), default=0)
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            # A prompt ending mid-character would glue its bytes onto the first output
            # token; the output must decode on its own, so start without context.
            context = []
        self._window: list[int] = context  # ids[prefix:], the only ids kept
        self._read = len(context)  # window[:read] is emitted; window[read:] is not yet
        self._pending = ""  # decoded, not emitted: it might begin a stop string
        self._text: list[str] = []
        self._done = False
        self.stopped: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text)

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new output token ids; return the newly final text (maybe "")."""
        delta = []
        for token_id in token_ids:
            if self._done:
                break
            self._window.append(token_id)
            delta.append(self._release(self._decode_new(final=False), final=False))
        return "".join(delta)

    def finish(self) -> str:
        """Generation ended for another reason than a stop string: flush held text,
        incomplete characters included (they decode as U+FFFD, as a full decode would)."""
        if self._done:
            return ""
        return self._release(self._decode_new(final=True), final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        """Text added by window[read:], or "" while it may still change."""
        prefix_text = self._decode(self._window[: self._read])
        new_text = self._decode(self._window)
        # Hold on a trailing U+FFFD (an unfinished byte sequence) and on tokens that add no
        # text yet (e.g. skipped special tokens): the next token may change how they decode.
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        # Slide: what was new becomes the context prefix for the next step.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return new_text[len(prefix_text) :]

    def _release(self, new_text: str, final: bool) -> str:
        """Apply stop strings to pending + new text; record and return what is safe."""
        text = self._pending + new_text
        # A match cannot start in emitted text (a possible start is always held), so
        # searching the pending text suffices.
        matches = [(i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if matches:
            cut, self.stopped = min(matches, key=lambda m: m[0])
            self._done = True
            text, self._pending = text[:cut], ""
        else:
            held = 0 if final else self._held_suffix_len(text)
            text, self._pending = text[: len(text) - held], text[len(text) - held :]
        self._done = self._done or final
        if text:
            self._text.append(text)
        return text

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self._max_stop_len - 1), 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self._stops):
                return n
        return 0
