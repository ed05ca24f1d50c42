"""`clover serve`'s settings, checked once at start so a bad flag fails before the socket opens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from clover.checkpoints import DEFAULT_MODEL, KNOWN_MODELS, device_dtype, resolve_device
from clover.decoding.policies import Source, draft_sources
from clover.decoding.settings import GenerationSettings
from clover.decoding.store import is_saved_store
from clover.errors import CloverError
from clover.serving.tenants import read_keys_file


@dataclass(frozen=True)
class ServeOptions:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    compile: bool = False  # torch.compile the causal passes (warmed up while loading)
    device: str = "cpu"  # cpu, cuda, cuda:N or auto (clover.checkpoints.resolve_device)
    adapter: str | None = None  # a draft adapter file (the model's own when None)
    drafter: str | None = None  # a drafter file (clover train drafter) for draft="drafter"
    wide: str = "int8"  # int4 from a GGUF: wider tensors' levels (clover.engine.LLM)
    store: tuple[str, ...] = ()  # seeds of the n-gram store (distill sets, saved stores, text)
    store_save: str | None = None  # a file keeping what answers taught the store, across runs
    store_save_every: float = 60.0  # seconds between writes of store_save (while it changed)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # one key, of the tenant "default"
    keys_file: str | None = None  # KEY TENANT [rpm=N] [tpm=N] lines (tenants.py); SIGHUP reloads
    rate_limit_rpm: int | None = None  # requests a minute per tenant, unless its keys say
    rate_limit_tpm: int | None = None  # tokens (prompt + generated) a minute per tenant
    header_timeout: float = 10.0  # seconds for a request's headers to arrive
    body_timeout: float = 60.0  # seconds for a request's body, after its headers
    max_connections_per_client: int = 64  # open connections per client address (0: any)
    served_model_name: str | None = None  # what clients put in "model"; default: the model's
    max_running: int = 8  # rows decoded together in one forward pass
    max_queue: int = 64  # requests waiting beyond those; more get 503
    request_timeout: float | None = 600.0  # seconds from arrival to the last token
    max_body_bytes: int = 4 * 1024 * 1024
    # what a request that leaves a setting out gets (`--decoder`, ..., `--max-tokens`)
    defaults: GenerationSettings = GenerationSettings()
    shutdown_grace: float = 30.0  # seconds in-flight answers get to finish on SIGTERM
    access_log: bool = False
    prefix_cache_mb: float | None = None  # prefixes kept across requests; None: model's size
    deterministic: bool = False  # one row at a time: answers independent of other traffic
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted beside localhost / IP literals
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any)
    sse_keepalive: float = 15.0  # seconds of silence before a stream sends a keep-alive

    def check(self) -> None:
        device_dtype(resolve_device(self.device), self.dtype)
        if not 0 <= self.port <= 65535:
            raise CloverError(f"--port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise CloverError(
                "--api-key (or $CLOVER_API_KEY) is empty, perhaps an unset shell variable: "
                "give a non-empty key, or leave both out to serve without one"
            )
        if self.keys_file is not None:
            if not read_keys_file(self.keys_file, None, None) and self.api_key is None:
                raise CloverError(f"--keys-file {self.keys_file} holds no key")
        for name in ("rate_limit_rpm", "rate_limit_tpm"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise CloverError(f"--{name.replace('_', '-')} must be >= 1")
        if not (self.header_timeout > 0 and self.body_timeout > 0):
            raise CloverError("--header-timeout and --body-timeout must be > 0 seconds")
        if self.max_connections_per_client < 0:
            raise CloverError("--max-connections-per-client must be >= 0 (0: no cap)")
        if self.max_running < 1 or self.max_queue < 0:
            raise CloverError("--max-running must be >= 1 and --max-queue >= 0")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise CloverError("--request-timeout must be > 0 seconds")
        if self.max_body_bytes < 1024:
            raise CloverError("--max-body-bytes must be at least 1024")
        self._check_defaults()
        if self.wide not in ("int8", "int4"):
            raise CloverError(f"--gguf-wide must be int8 or int4, got {self.wide!r}")
        if self.shutdown_grace < 0:
            raise CloverError("--shutdown-grace must be >= 0")
        if self.prefix_cache_mb is not None and self.prefix_cache_mb < 0:
            raise CloverError("--prefix-cache-mb must be >= 0 (0 turns the cache off)")
        if not self.sse_keepalive > 0:
            raise CloverError("--sse-keepalive must be > 0 seconds")
        self._check_store()
        for host in self.allowed_hosts:
            if not host or any(c in host for c in "/ :@"):
                raise CloverError(
                    f"--allowed-hosts: {host!r} is not a host name (no scheme, port or path)"
                )
        for origin in self.cors_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise CloverError(
                    f"--cors-origins: {origin!r} must be * or scheme://host[:port], "
                    "e.g. http://localhost:3000"
                )

    def _check_defaults(self) -> None:
        """What the request defaults need beyond their own ranges (`GenerationSettings`)."""
        d = self.defaults
        uses_drafter = d.draft is not None and Source.DRAFTER in draft_sources(d.draft)
        if uses_drafter and self.drafter in (None, "none"):
            entry = KNOWN_MODELS.get(self.model.strip().lower())
            if entry is None or entry.default_drafter is None or self.drafter == "none":
                raise CloverError(
                    f"--draft {d.draft} needs --drafter FILE (clover train drafter) or "
                    "--drafter MODEL (a smaller model of its tokenizer)"
                )
        if d.tree and not uses_drafter:
            raise CloverError("--tree grows trees from a drafter: add --draft drafter")
        if d.slide and d.decoder != "low_confidence":
            raise CloverError("--slide is a low_confidence option: add --decoder low_confidence")

    def _check_store(self) -> None:
        for seed in self.store:
            if not Path(seed).exists():
                raise CloverError(f"--store {seed}: no such file or directory")
        if self.store_save is None:
            return
        path = Path(self.store_save)
        if path.is_dir() or not path.parent.is_dir():
            raise CloverError(
                f"--store-save {path}: must be a file in an existing directory (it is "
                "created on the first write)"
            )
        if path.exists() and not is_saved_store(path):
            raise CloverError(
                f"--store-save {path}: the file exists and is not a saved n-gram store; "
                "refusing to overwrite it (give a new file name)"
            )
        if any(Path(seed).resolve() == path.resolve() for seed in self.store):
            raise CloverError(
                f"{path} is given to both --store and --store-save: --store-save reads it "
                "already, give it once"
            )
        if not self.store_save_every > 0:
            raise CloverError("store_save_every must be > 0 seconds")
