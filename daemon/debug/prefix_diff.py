"""`tokenloom debug prefix-diff A.json B.json`: where do two requests' token sequences
first diverge? The seeds' advice for a cache miss: diff the tokenized prefixes, not the raw
strings — whitespace, JSON key order or a timestamp early in the prompt all end reuse.

Request bodies are OpenAI completions (`prompt`: text or token ids) or chat (`messages`,
through the model's chat template, as the server would tokenize them).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True)
class PrefixDiff:
    len_a: int
    len_b: int
    common: int                 # tokens shared from position 0
    block_size: int

    @property
    def identical(self) -> bool:
        return self.len_a == self.len_b == self.common

    @property
    def first_divergent_block(self) -> int:
        return self.common // self.block_size

    @property
    def reusable_tokens(self) -> int:
        """What the later request could take from the prefix cache: full shared blocks,
        never the block holding its own last token."""
        shared_blocks = self.common // self.block_size
        return min(shared_blocks, max(0, (self.len_b - 1) // self.block_size)) * self.block_size


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_body(tokenizer, body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        return list(tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    raise ValueError("a request body needs `messages` or a single `prompt` (text or token ids)")


def render(tokenizer, a: list[int], b: list[int], d: PrefixDiff, names=("A", "B"),
           context: int = 8) -> str:
    lines = [f"{names[0]}: {d.len_a} tokens   {names[1]}: {d.len_b} tokens   "
             f"block size {d.block_size}"]
    if d.identical:
        lines.append("identical token sequences")
    else:
        lines.append(f"first difference at token {d.common} (block {d.first_divergent_block}, "
                     f"offset {d.common % d.block_size}); {d.common} tokens shared")
        lo = max(0, d.common - context)
        for name, ids in zip(names, (a, b)):
            before = tokenizer.decode(ids[lo:d.common])
            after = tokenizer.decode(ids[d.common:d.common + context])
            lines.append(f"  {name}: ...{before!r} ⟦ {after!r} ⟧")
    lines.append(f"{names[1]} after {names[0]} can reuse {d.reusable_tokens} cached tokens "
                 f"({d.reusable_tokens // d.block_size} full blocks)")
    return "\n".join(lines)


def run(tokenizer, path_a: Path, path_b: Path, block_size: int) -> str:
    a = tokenize_body(tokenizer, json.loads(Path(path_a).read_text()))
    b = tokenize_body(tokenizer, json.loads(Path(path_b).read_text()))
    d = PrefixDiff(len(a), len(b), common_prefix(a, b), block_size)
    return render(tokenizer, a, b, d, names=(Path(path_a).name, Path(path_b).name))
