"""The package version (one place: `clover --version`, the server's banner and API)."""

__version__ = "0.1.0"
