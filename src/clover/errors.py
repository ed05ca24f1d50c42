"""One exception type for every problem a user can cause or fix.

The CLI and the server catch `CloverError` and print only its message: messages must name the
problem (which file, which tensor, which limit) and never carry a traceback or a secret path
from a request.
"""


class CloverError(Exception):
    """A clear, user-facing error: bad input, missing file, unsupported checkpoint."""
