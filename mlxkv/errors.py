"""Exception hierarchy of mlxkv.

Owns every error the library raises on purpose. Each message says what went wrong, with numbers
and units, and what to do about it.
"""


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


class CacheStateError(MlxkvError):
    """A saved or restored cache state does not fit the cache it is loaded into."""


class ModelLoadError(MlxkvError):
    """A model could not be found or loaded."""


class UnsupportedFormatError(ModelLoadError):
    """A model file uses an architecture or tensor type mlxkv cannot read."""


class ContextLengthError(MlxkvError, ValueError):
    """A request does not fit in the context window."""


class RunnerBusyError(MlxkvError, RuntimeError):
    """A Runner call that would wait forever: this thread holds an unfinished `stream()`."""
