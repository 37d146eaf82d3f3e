"""tokenloom — an LLM inference serving daemon.

The installed import package `tokenloom` is this folder: `tokenloom.actors` lives in
`actors/`, `tokenloom.kernels` in `kernels/`, and so on (see pyproject.toml).
"""

import os
import sys

__version__ = "0.1.0"


def _not_an_import_root() -> None:
    """Drop this folder from sys.path. `python -m ...` run from the checkout puts it there, and
    then its subfolders shadow PyPI packages of the same names: transformers >= 5.25 imports
    the `kernels` package from the hub and would get `tokenloom.kernels` instead."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]


_not_an_import_root()


def __getattr__(name: str):
    # Lazy so that `import tokenloom.config` does not pull in torch.
    if name == "LLM":
        from tokenloom.actors.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenloom.actors.sampling_params import SamplingParams

        return SamplingParams
    if name == "GuidedDecoding":
        from tokenloom.actors.sampling_params import GuidedDecoding

        return GuidedDecoding
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "GuidedDecoding", "__version__"]
