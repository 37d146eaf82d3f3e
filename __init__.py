"""tokenloom — an LLM inference serving daemon.

The installed import package `tokenloom` is this folder: `tokenloom.actors` lives in
`actors/`, `tokenloom.kernels` in `kernels/`, and so on (see pyproject.toml).
"""

__version__ = "0.1.0"


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
