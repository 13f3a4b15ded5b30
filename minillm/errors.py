"""Errors that end in a clear message for the user (the CLI prints them, exit status 1)."""


class MinillmError(Exception):
    """Base class: an error whose message is meant for the user, not a traceback. params: the
    library parameters the message names, spelled as in the message (n_ctx, truncate, ...), so
    that a front end can put its own names for them instead: the CLI its flags."""

    def __init__(self, message: str, params: tuple[str, ...] = ()):
        super().__init__(message)
        self.params = params


class GGUFError(MinillmError):
    """The file is not a valid GGUF file, or lies about its contents."""


class ModelError(MinillmError):
    """The GGUF file is valid but does not describe a model we can run."""


class UnsupportedError(ModelError):
    """The file is valid and its architecture known, but it asks for arithmetic that the
    architecture's module does not implement (a key, a tensor, a scaling type): refused by name
    rather than computed differently."""
