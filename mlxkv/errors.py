"""Exception hierarchy of mlxkv, and the checks of user settings that raise ValueError.

Owns every error the library raises on purpose. Each message says what went wrong, with numbers
and units, and what to do about it. `check_int` / `check_real` refuse a float where an int
belongs (`max_context=2.5`) or a bool where a number belongs, instead of truncating it.
"""

import math
import numbers


class MlxkvError(Exception):
    """Base class of every error mlxkv raises on purpose."""


class CacheFullError(MlxkvError):
    """A cache of fixed capacity cannot take the batch it was given.

    Attributes:
        capacity_tokens: how many tokens the cache can hold.
    """

    def __init__(self, message: str, capacity_tokens: int):
        super().__init__(message)
        self.capacity_tokens = capacity_tokens


class NotSupportedError(MlxkvError):
    """The operation is not possible for this cache or model (e.g. trimming a recurrent layer)."""


class ModelNamedError(MlxkvError):
    """An error whose message names the model it refuses.

    Attributes:
        model_name: the model as the message names it; a server names it as its clients do
            (`for_model`), not by the directory it was loaded from.
    """

    def __init__(self, model_name: str, wording: str):
        """`wording` holds `{model}` where the model's name goes."""
        super().__init__(wording.format(model=model_name))
        self.model_name = model_name
        self._wording = wording

    def for_model(self, model_name: str) -> str:
        """The message naming the model `model_name` instead."""
        return self._wording.format(model=model_name)


class ModelNotSupportedError(ModelNamedError, NotSupportedError):
    """A model that cannot do what was asked (embeddings from a model without hidden states,
    text from an encoder embedding model)."""


class ModelInputError(ModelNamedError, ValueError):
    """Input this model cannot take (a `dimensions` past its width): bad user input."""


class ImagesNotSupportedError(ModelNotSupportedError, ValueError):
    """Images sent to a model without vision (bad user input: also a ValueError)."""

    def __init__(self, model_name: str):
        super().__init__(
            model_name,
            "model {model} does not take images; send text only, or load a vision-language model",
        )


class CacheStateError(MlxkvError):
    """A saved or restored cache state does not fit the cache it is loaded into."""


class RestoreBroken(CacheStateError):
    """A layer of a cache restored from disk while it was used (streamed) failed its check:
    nothing computed from it may be kept (`mlxkv.cache.gate`)."""


class ModelLoadError(MlxkvError):
    """A model could not be found or loaded."""


class UnsupportedFormatError(ModelLoadError):
    """A model file uses an architecture or tensor type mlxkv cannot read."""


class ContextLengthError(MlxkvError, ValueError):
    """A request does not fit in the context window.

    Attributes (None where the error is not about them; the APIs word their errors from them):
        prompt_tokens: the prompt's length in tokens.
        max_tokens: the tokens asked for after it, when the prompt fits but they do not.
        max_context: the window, in tokens.
    """

    def __init__(
        self,
        message: str,
        *,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        max_context: int | None = None,
    ):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_context = max_context


class GrammarError(MlxkvError, ValueError):
    """A grammar (or JSON schema) the grammar engine cannot follow: one it cannot convert, or
    one it gives up on mid-reply (llguidance's limits on what it builds, reached only once
    tokens come). Bad input: the request that asked for it ends, and no other."""


class RunnerBusyError(MlxkvError, RuntimeError):
    """A Runner call that would wait forever: this thread holds an unfinished `stream()`."""


class RanksOutOfStepError(MlxkvError, RuntimeError):
    """A sharded Runner's ranks stopped answering each other (one froze or died): every
    later request fails at once; restart every rank."""


def check_int(name: str, value: object, *, low: int, high: int | None = None) -> None:
    """Raises ValueError unless `value` is an int (not a bool) in [low, high]."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        upper = f" and <= {high}" if high is not None else ""
        raise ValueError(f"{name} must be >= {low}{upper}, got {value}")


def check_real(name: str, value: object, *, low: float, high: float | None = None) -> None:
    """Raises ValueError unless `value` is a finite number (not a bool) in [low, high]."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        span = f"in [{low}, {high}]" if high is not None else f">= {low} and finite"
        raise ValueError(f"{name} must be {span}, got {value}")
