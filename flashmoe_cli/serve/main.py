"""`flashmoe serve`: load the model, print where it listens, serve until Ctrl-C or SIGTERM.

Starlette and uvicorn: the ASGI pair most Python model servers use (vLLM, SGLang and mlx-lm's
own OpenAI server all build on one or both); SSE streaming, disconnect detection and graceful
shutdown come with them instead of being written here.
"""

from __future__ import annotations

import contextlib
import signal
import sys

from ..errors import UsageError
from ..exit_codes import ExitCode


def model_id(args) -> str:
    """The name clients send as `model`: the folder's name (the demo: "demo")."""
    from pathlib import Path

    return "demo" if not args.model else Path(str(args.model).rstrip("/")).name or str(args.model)


def cmd_serve(args) -> int:
    from ..startup import EngineOptions, make_engine

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: not a port number (0-65535)")
    if not 0 < args.keepalive <= 10:  # agents' idle timeouts: a silent stream looks dead to them
        raise UsageError(f"--keepalive {args.keepalive}: give seconds between 0 and 10")
    if not 0 < args.read_timeout <= 3600:
        raise UsageError(f"--read-timeout {args.read_timeout}: give seconds between 0 and 3600")
    if args.max_body < 1024:
        raise UsageError(f"--max-body {args.max_body}: give at least 1KB")
    from .keys import load_keys

    keys = load_keys(args.api_key, args.api_key_file)  # before the model loads: a bad key is said at once
    try:
        import uvicorn

        from .app import Server
        from .limits import Limits
        from .slow_clients import protocol
    except ImportError as e:
        raise UsageError(f"flashmoe serve needs {e.name} (pip install starlette uvicorn)") from None
    print("flashmoe: loading the model...", file=sys.stderr, flush=True)
    engine = make_engine(EngineOptions.from_args(args))
    try:
        info = engine.wait_loaded()
        name = model_id(args)
        server = Server(
            engine,
            info,
            name,
            api_keys=keys,
            max_queue=args.max_queue,
            tenant_header=args.tenant_header,
            host=args.host,
            allow_hosts=tuple(args.allow_host),
            limits=Limits(max_body=args.max_body, read_timeout=args.read_timeout),
            default_max_tokens=args.max_tokens,
            allow_origins=tuple(args.allow_origin),
            served_names=tuple(args.served_model_name),
            strict_fields=args.strict_fields,
            keepalive_s=args.keepalive,
            force_first_call=args.force_first_call,
            temperature=args.temp,
            repetition_penalty=args.repetition_penalty,
        )
        _more_descriptors()
        config = uvicorn.Config(
            server.app(),
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=30,
            lifespan="off",
            http=protocol(args.read_timeout),
        )

        class Announcing(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                """Ctrl-C / SIGTERM: stop accepting, finish what runs, and exit 0 (uvicorn's own
                re-raises the signal after shutdown, which exits 130 / 143)."""
                old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for sig, handler in old.items():
                        signal.signal(sig, handler)

            async def startup(self, sockets=None):
                await super().startup(sockets)
                if not self.should_exit:
                    port = self.servers[0].sockets[0].getsockname()[1]
                    key = f"; every request needs an API key ({len(keys)} taken)" if keys else ""
                    bits = f"{info.bits}-bit" if info.bits else "unquantized"
                    print(
                        f"flashmoe: serving {server.model_id} ({info.model_type}, {bits}, "
                        f"K={info.top_k} of {info.experts} experts) at http://{args.host}:{port}/v1{key}",
                        file=sys.stderr,
                        flush=True,
                    )

        try:
            Announcing(config).run()  # Ctrl-C / SIGTERM: stop accepting, finish what runs, return
        except SystemExit:  # it could not listen (uvicorn said why on stderr)
            raise UsageError(f"--host {args.host} --port {args.port}: cannot listen there") from None
        return ExitCode.OK
    finally:
        engine.close()


def _more_descriptors() -> None:
    """Raise the open-files limit to what the system allows (many hold 1,024 by default, the
    hard limit far more): a flood of connections reaches the limit later, and the read timeout
    (slow_clients.py) frees them before."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 1 << 16
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, 1 << 20), hard))
    except (ImportError, ValueError, OSError):
        pass
