"""One exception type for every problem a user can cause or fix.

The CLI and the server catch `CloverError` and print only its message: messages must name the
problem (which file, which tensor, which limit) and never carry a traceback or a secret path
from a request.
"""


class CloverError(Exception):
    """A clear, user-facing error: bad input, missing file, unsupported checkpoint."""


class ContextTooLong(CloverError):
    """A prompt (with what it asks to generate) does not fit the model's context: the
    server answers it as OpenAI does, `context_length_exceeded`."""
