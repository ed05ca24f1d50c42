"""`clover serve`: run the app under uvicorn, with a graceful drain on SIGTERM.

uvicorn alone, on SIGTERM, stops listening at once and then waits for open connections, so
a new request would see a refused connection rather than an answer. We want load balancers to
see the drain, so the first SIGTERM (or Ctrl-C) only marks the server as draining: the socket
stays open, new requests get 503, running answers finish (up to `--shutdown-grace` seconds;
then they are cut), and only then does uvicorn stop. A second signal stops it at once.

The URL and a sample `curl` are printed once the socket is bound (so `--port 0` prints the
real port), before the model has finished loading; `/health` tells when it is ready. A model
that fails to load stops the server with exit status 1.

SIGHUP reads `--keys-file` again (a file that does not parse is reported and the keys in use
stay). uvicorn runs with Clover's h11 protocol (`connections.guarded_protocol`): header and body
timeouts and a cap on connections per client address.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from clover.engine import LLM
from clover.errors import CloverError
from clover.serving.app import create_app
from clover.serving.connections import guarded_protocol
from clover.serving.options import ServeOptions
from clover.serving.runtime import Runtime

__all__ = ["ServeOptions", "serve", "uvicorn_config"]


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, options: ServeOptions) -> None:
        super().__init__(config)
        self.options = options
        self.runtime = config.app.state.runtime
        self.runtime.on_failure = self._load_failed
        self._draining = False

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(_banner(self.options, host, port), flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining:  # a second signal: stop now
            self.force_exit = self.should_exit = True
            return
        self._draining = True
        print("clover serve: draining (signal again to stop now)", file=sys.stderr, flush=True)
        threading.Thread(target=self._drain, name="clover-drain", daemon=True).start()

    def _drain(self) -> None:
        self.runtime.drain(self.options.shutdown_grace)
        self.should_exit = True

    def _load_failed(self) -> None:
        print(f"error: {self.runtime.error}", file=sys.stderr, flush=True)
        self.should_exit = True


def uvicorn_config(app: FastAPI, options: ServeOptions, **overrides: object) -> uvicorn.Config:
    """The app under uvicorn as `clover serve` runs it."""
    settings = dict(
        host=options.host,
        port=options.port,
        log_level="warning",
        access_log=options.access_log,
        server_header=False,
        timeout_graceful_shutdown=5,  # answers are already drained when uvicorn stops
        timeout_keep_alive=5,
        http=guarded_protocol(app.state.runtime.connections),
    )
    return uvicorn.Config(app, **{**settings, **overrides})


def reload_keys(runtime: Runtime) -> None:
    """SIGHUP: the keys file again; a bad file is reported and the keys in use stay."""
    try:
        n = runtime.keys.reload()
    except CloverError as e:
        print(f"clover serve: keys not reloaded, the old ones stay: {e}", file=sys.stderr)
        return
    print(f"clover serve: {n} keys loaded", file=sys.stderr, flush=True)


def serve(options: ServeOptions, loader: Callable[[], LLM] | None = None) -> int:
    """Serve until stopped; returns the exit status (1 if the model failed to load)."""
    options.check()
    app = create_app(options, loader)
    config = uvicorn_config(app, options)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda _sig, _frame: reload_keys(app.state.runtime))
    server = DrainingServer(config, options)
    local = options.host in ("127.0.0.1", "localhost", "::1")
    if not (options.api_key or options.keys_file) and not local:
        print(
            f"warning: serving on {options.host} without --api-key: anyone who can reach "
            "this port can use the model",
            file=sys.stderr,
        )
    server.run()
    return 1 if server.runtime.error is not None else 0


def _banner(options: ServeOptions, host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    body = '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64}'
    keyed = options.api_key or options.keys_file
    auth = ' -H "Authorization: Bearer $CLOVER_API_KEY"' if keyed else ""
    return (
        f"clover serve: {options.model} at {url} (loading; {url}/health says when ready)\n"
        f"  web page: {url}/\n"
        f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d {shlex.quote(body)}"
    )
