"""How the served model makes an embedding, as its directory says (sentence-transformers'
files, which is what Qwen3-Embedding and the other decoder embedders ship):

- `modules.json` lists the pipeline: a `sentence_transformers.models.Pooling` module (its
  `<path>/config.json` says the mode: `pooling_mode_lasttoken`, `pooling_mode_mean_tokens`
  or `pooling_mode_cls_token`) and, for unit vectors, a `...models.Normalize` module.
- Without `modules.json` a decoder model is pooled as vLLM pools one: its last token,
  normalized.
- `config.json`'s `matryoshka_dimensions` (the sizes it was trained to be cut to) or
  `is_matryoshka` (any size) allow a request's `dimensions`, as vLLM reads them; otherwise
  cutting the vector would silently lose quality, so a request asking for it is refused.

Pure; `load` reads files and raises PoolingConfigError for a mode this server cannot pool.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
          ("pooling_mode_cls_token", "cls"))
_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens")


class PoolingConfigError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    kind: str                                # SamplingParams.pooling: last | mean | cls
    normalize: bool
    hidden_size: int
    matryoshka: bool = False                 # `dimensions` may cut the vector
    dimensions: tuple[int, ...] | None = None   # the sizes allowed (None: any)

    def check_dimensions(self, dimensions: int) -> str | None:
        """Why `dimensions` cannot be served, or None."""
        if not self.matryoshka:
            return ("this model does not support Matryoshka representation: its vectors "
                    f"cannot be cut to fewer dimensions than {self.hidden_size} without "
                    "losing quality")
        if not 1 <= dimensions <= self.hidden_size:
            return f"must be in [1, {self.hidden_size}], got {dimensions}"
        if self.dimensions is not None and dimensions not in self.dimensions:
            return (f"must be one of the model's matryoshka_dimensions "
                    f"({', '.join(map(str, self.dimensions))}), got {dimensions}")
        return None


def load(model_dir: str | Path, hidden_size: int) -> PoolingConfig:
    model_dir = Path(model_dir)
    kind, normalize = "last", True
    modules = _json(model_dir / "modules.json")
    if isinstance(modules, list):
        normalize = False
        for m in modules:
            mtype = str(m.get("type", "")) if isinstance(m, dict) else ""
            if mtype.endswith("Pooling"):
                kind = _mode(_json(model_dir / str(m.get("path", "")) / "config.json") or {})
            elif mtype.endswith("Normalize"):
                normalize = True
    config = _json(model_dir / "config.json") or {}
    dims = config.get("matryoshka_dimensions")
    allowed = tuple(int(d) for d in dims) if isinstance(dims, list) and dims else None
    matryoshka = allowed is not None or bool(config.get("is_matryoshka"))
    return PoolingConfig(kind, normalize, hidden_size, matryoshka, allowed)


def _mode(cfg: dict) -> str:
    for key, kind in _MODES:
        if cfg.get(key):
            return kind
    for key in _UNSUPPORTED:
        if cfg.get(key):
            raise PoolingConfigError(f"the model's pooling ({key}) is not supported; "
                                     "last-token, mean and CLS pooling are")
    return "last"


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
