"""nanospec-serve: the OpenAI API over one nanospec engine (FastAPI + uvicorn, Prometheus metrics).

    nanospec-serve [MODEL_DIR] [--host 127.0.0.1] [--port 8000] [--assistant DIR|default|none]
    python -m nanospec.serve ...           # the same; every LLM option is a --kebab-case flag (--help)

--assistant auto (the default) is the shipped assistant on the default model and none on any other.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (200; 503 once the
engine thread has died), GET /metrics (vLLM's metric names), POST /tokenize, POST /detokenize, GET
/tokenizer_info (vLLM's shapes). With --api-key or the environment variable NANOSPEC_API_KEY every endpoint
but /health needs `Authorization: Bearer KEY`. docs/serving.md: the fields, limits and what is refused.

The code: protocol.py reads the requests, engine.py runs the engine thread (handlers never call the LLM;
it wakes them once per step), app.py holds the handlers and ``build_app``, this file the command line.
"""

import argparse
import importlib
import os
import socket
from dataclasses import fields

from ..config import EngineConfig
from ..tools.cli import auto_assistant, configure_cpu_threads, number, or_error, parser

KEY_ENV = "NANOSPEC_API_KEY"


def parse_args(argv=None):
    """``nanospec-serve``'s options; the engine's go through ``EngineConfig``'s own checks here, before any
    weights load. Returns (parser, args, LLM keyword arguments)."""
    ap, a = parser("nanospec-serve", __doc__)
    a("model", nargs="?", help="HF-format model dir (default: SmolLM2-135M-Instruct)")
    a("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    a("--port", type=number(int, 0), default=8000, help="0: any free port (printed once listening)")
    a("--api-key", help=f"the key every endpoint but /health needs (default: env {KEY_ENV})")
    a("--max-n", type=number(int, 1), default=16, help="largest `n` of a request")
    a("--max-waiting", type=number(int, 1), default=1024, help="most waiting requests (more: 503)")
    engine_fields = [f for f in fields(EngineConfig) if f.name not in ("model", "trace")]
    for f in engine_fields:  # every LLM option, as --kebab-case; EngineConfig checks the values below
        typ = {int: int, int | None: int, float: float}.get(f.type, str)
        kw = dict(action=argparse.BooleanOptionalAction) if f.type in (bool, bool | None) else dict(type=typ)
        default = "auto" if f.name == "assistant" else f.default
        a("--" + f.name.replace("_", "-"), default=default, help=f"LLM({f.name}=...)", **kw)
    args = ap.parse_args(argv)
    args.api_key = args.api_key or os.environ.get(KEY_ENV)  # read after parsing: --help never shows it
    kw = {f.name: getattr(args, f.name) for f in engine_fields}
    assistant = auto_assistant(args.model) if args.assistant == "auto" else args.assistant
    kw["assistant"] = None if assistant == "none" else assistant
    or_error(ap, "", EngineConfig, model=args.model, **kw)
    return ap, args, kw


def main(argv=None) -> None:
    """Check the options, bind the port, load the engine, then listen and print ``listening on URL``."""
    ap, args, kw = parse_args(argv)
    hint = "the server needs the `serve` extra (pip install -e '.[serve]'): "
    uvicorn = or_error(ap, hint, importlib.import_module, "uvicorn", errors=ImportError)
    app_module = or_error(ap, hint, importlib.import_module, "nanospec.serve.app", errors=ImportError)

    from .. import LLM, default_model

    # bound before the weights load (a taken port fails at once), listening once the engine is ready; a port
    # over 65535: OverflowError
    sock = socket.socket()  # IPv4
    where = f"cannot listen on --host {args.host} --port {args.port}: "
    or_error(ap, where, sock.bind, (args.host, args.port), errors=(OSError, OverflowError))
    configure_cpu_threads()
    llm = or_error(ap, "", LLM, args.model, errors=ValueError, **kw)
    name = args.model or default_model.DEFAULT_MODEL_NAME  # what clients send as `model`
    app = app_module.build_app(llm, name, args.api_key, args.max_n, args.max_waiting)
    sock.listen(2048)
    host, port = sock.getsockname()
    print(f"nanospec-serve: {name} listening on http://{host}:{port}", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
