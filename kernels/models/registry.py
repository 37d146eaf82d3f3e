"""Which architectures tokenloom runs: one small file per family in
kernels/models/families/, found here at import.

A family states what its layers need — options of the shared decoder
(kernels/models/decoder.py) such as q/k norms, a soft-cap or sliding-window layers — and
where its checkpoint keeps each tensor when that is not where Llama keeps it. Kernels (the
C++ CPU ones, the Triton ones) implement each option once, for every family. Adding a
family is one file in families/ defining `FAMILY` (or `FAMILIES`), plus its tests.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Callable, Mapping

from tokenloom.kernels.models.model_spec import ModelSpec, UnsupportedModelError, base_spec


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    # config -> the ModelSpec fields this family sets beyond the common ones (base_spec)
    options: Callable[[Any], dict]
    # Our layer-relative tensor name -> the checkpoint's, where they differ (Gemma's norms).
    renames: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # The LoRA target modules (PEFT names) an adapter of this family may carry.
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj")
    summary: str = ""          # one line for the supported-models table

    def spec(self, cfg: Any) -> ModelSpec:
        return base_spec(cfg, self.name, **self.options(cfg))


def _discover() -> dict[str, Family]:
    from tokenloom.kernels.models import families

    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(families.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{families.__name__}.{info.name}")
        for fam in getattr(module, "FAMILIES", None) or [module.FAMILY]:
            for arch in fam.architectures:
                assert arch not in found, f"{arch} claimed by {found[arch].name} and {fam.name}"
                found[arch] = fam
    return found


_BY_ARCHITECTURE: dict[str, Family] | None = None


def families_by_architecture() -> dict[str, Family]:
    global _BY_ARCHITECTURE
    if _BY_ARCHITECTURE is None:
        _BY_ARCHITECTURE = _discover()
    return _BY_ARCHITECTURE


def supported_architectures() -> list[str]:
    return sorted(families_by_architecture())


def family_for(architecture: str) -> Family:
    fam = families_by_architecture().get(architecture)
    if fam is None:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r} "
            f"(supported: {', '.join(supported_architectures())})")
    return fam


def markdown_table() -> str:
    """The supported-architectures table of docs/models.md (its test keeps the page current)."""
    rows = ["| architecture | family | what its layers need |", "|---|---|---|"]
    rows += [f"| `{arch}` | {fam.name} | {fam.summary} |"
             for arch, fam in sorted(families_by_architecture().items())]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
