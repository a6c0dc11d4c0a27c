"""The page's web server: a WSGI app (Werkzeug) on 127.0.0.1, serving only the holder of its token.

Werkzeug, not a framework: routing, request and response objects, a threaded server, and nothing
else to pull in (MarkupSafe is its one dependency); the page's work is blocking calls over SSH,
which a thread per request serves as well as anything.

Who may ask, checked before any route (:meth:`App.refusal`):

* the token, in the URL the command printed (``?token=...``, as Jupyter does), then in a cookie the
  first answer sets (HttpOnly, SameSite=Strict), or in an ``X-RV-Token`` header: without it, 403;
* the Host header, ``127.0.0.1:PORT`` or ``localhost:PORT``: a name another site resolved to
  127.0.0.1 (DNS rebinding) is refused;
* the Origin header, when there is one, must be this server's: a page of another origin is refused
  even if the browser would send the cookie; a POST (the two actions) must carry it.

Answers are JSON, except the page itself and its static files; an RvError becomes
``{"error", "hint"}`` with 400 (bad input), 404 (no such run) or 502 (the cluster failed us).
"""

from __future__ import annotations

import hmac
import json
import mimetypes
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

from werkzeug.exceptions import HTTPException, NotFound
from werkzeug.routing import Map, Rule
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server
from werkzeug.wrappers import Request, Response

from rv.errors import NotFound as RvNotFound
from rv.errors import RvError, UsageError
from rv.ui import data

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

    from rv.job.records import RunStore

COOKIE = "rv-ui-token"
HOST = "127.0.0.1"  # never another interface: the page can stop runs
# The page's own script and styles only; uPlot sets element styles from script, which CSP allows.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)


def new_token() -> str:
    return secrets.token_urlsafe(24)


def static_files() -> dict[str, bytes]:
    """Every file of rv/ui/static by name, read once (the only files the server ever sends)."""
    folder = resources.files("rv.ui") / "static"
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


class App:
    """The WSGI application. ``clusters``: one per profile (rv.ui.data.Cluster)."""

    def __init__(self, clusters: Mapping[str, data.Cluster], store: RunStore, token: str) -> None:
        self.clusters = clusters
        self.store = store
        self.token = token
        self.port = 0  # set once the server is bound (the Host and Origin checks need it)
        self.static = static_files()
        self.urls = Map(
            [
                Rule("/", endpoint="index"),
                Rule("/static/<name>", endpoint="static"),
                Rule("/api/profiles", endpoint="profiles"),
                Rule("/api/runs", endpoint="runs"),
                Rule("/api/run", endpoint="run"),
                Rule("/api/logs", endpoint="logs"),
                Rule("/api/metrics", endpoint="metrics"),
                Rule("/api/sweep", endpoint="sweep"),
                Rule("/api/stop", endpoint="stop", methods=["POST"]),
                Rule("/api/retry", endpoint="retry", methods=["POST"]),
            ]
        )

    # -- who may ask ---------------------------------------------------------------------------------
    def origins(self) -> set[str]:
        return {f"http://{HOST}:{self.port}", f"http://localhost:{self.port}"}

    def refusal(self, request: Request) -> str | None:
        """Why ``request`` is refused (None: served)."""
        if request.host not in {f"{HOST}:{self.port}", f"localhost:{self.port}"}:
            return f"host {request.host!r} is not this server"
        origin = request.headers.get("Origin")
        if origin is not None and origin not in self.origins():
            return f"a request from another origin ({origin}) is refused"
        if request.method == "POST" and origin is None:
            return "an action must come from the page (no Origin header)"
        if request.headers.get("Sec-Fetch-Site") == "cross-site":
            return "a request from another site is refused"
        given = (
            request.args.get("token")
            or request.headers.get("X-RV-Token")
            or request.cookies.get(COOKIE)
            or ""
        )
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return "no valid token: open the URL `rv ui` printed (it carries ?token=...)"
        return None

    # -- WSGI ----------------------------------------------------------------------------------------
    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        request = Request(environ)
        response = self.respond(request)
        response.headers.setdefault("Content-Security-Policy", CSP)
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["Cache-Control"] = "no-store"
        return response(environ, start_response)

    def respond(self, request: Request) -> Response:
        why = self.refusal(request)
        if why is not None:
            return _json({"error": why}, 403)
        adapter = self.urls.bind_to_environ(request.environ)
        try:
            endpoint, values = adapter.match()
            handler: Callable[..., Response] = getattr(self, f"on_{endpoint}")
            response = handler(request, **values)
        except HTTPException as exc:
            return _json({"error": exc.description or exc.name}, exc.code or 500)
        except RvError as exc:
            code = 400 if isinstance(exc, UsageError) else 404 if isinstance(exc, RvNotFound) else 502
            return _json({"error": exc.message, "hint": exc.hint}, code)
        if request.args.get("token"):
            # The URL's token becomes a cookie: the page's own requests carry it from now on.
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="Strict", path="/")
        return response

    # -- the page ------------------------------------------------------------------------------------
    def on_index(self, request: Request) -> Response:
        return Response(self.static["index.html"], mimetype="text/html")

    def on_static(self, request: Request, name: str) -> Response:
        if name not in self.static:
            raise NotFound()
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        return Response(self.static[name], mimetype=kind)

    # -- what it shows -------------------------------------------------------------------------------
    def cluster(self, request: Request, values: Mapping[str, Any] | None = None) -> data.Cluster:
        name = (values or request.args).get("profile") or ""
        if not isinstance(name, str):
            raise UsageError(f"profile: a profile's name, a string (not {_kind(name)})")
        if name not in self.clusters:
            known = ", ".join(self.clusters)
            raise UsageError(f"no profile {name!r} in the config (there are: {known})")
        return self.clusters[name]

    def on_profiles(self, request: Request) -> Response:
        return _json({"profiles": data.profiles(self.clusters)})

    def on_runs(self, request: Request) -> Response:
        finished = request.args.get("all", "1") != "0"
        return _json(data.runs(self.cluster(request), finished=finished))

    def on_run(self, request: Request) -> Response:
        return _json(data.run(self.cluster(request), _arg(request, "id")))

    def on_logs(self, request: Request) -> Response:
        raw = request.args.get("cursor")
        cursor = _cursor(raw) if raw else None
        start = request.args.get("from")
        if start and not (start.isascii() and start.isdigit()):
            raise UsageError(f"from: a segment number (not {start[:40]!r})")
        return _json(
            data.logs(
                self.cluster(request), _arg(request, "id"), stream=request.args.get("stream", "out"),
                cursor=cursor, from_segment=int(start) if start else None,
            )
        )  # fmt: skip

    def on_metrics(self, request: Request) -> Response:
        return _json(data.metrics(self.cluster(request), _arg(request, "id")))

    def on_sweep(self, request: Request) -> Response:
        return _json(data.sweep(self.cluster(request), _arg(request, "name")))

    # -- the two actions (POST, JSON bodies) ---------------------------------------------------------
    def on_stop(self, request: Request) -> Response:
        body = _body(request)
        run_id, sweep = _text(body, "run_id"), _text(body, "sweep")
        return _json(data.stop(self.cluster(request, body), self.store, run_id=run_id, sweep=sweep))

    def on_retry(self, request: Request) -> Response:
        body = _body(request)
        notes: list[str] = []
        sweep = _text(body, "sweep")
        if sweep is None:
            raise UsageError("sweep: the name of the sweep to retry")
        answer = data.retry(self.cluster(request, body), self.store, sweep, notes)
        return _json({**answer, "notes": notes})


def _arg(request: Request, name: str) -> str:
    value = request.args.get(name)
    if not value:
        raise UsageError(f"missing ?{name}=")
    return value


def _kind(value: Any) -> str:
    """A JSON value's kind, for a message (never the value: it may be anything)."""
    names = {bool: "true/false", int: "a number", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}  # fmt: skip
    return names.get(type(value), type(value).__name__)


def _text(body: Mapping[str, Any], key: str) -> str | None:
    """``body[key]``: a non-empty string, or absent (None); anything else is a 400 naming the key."""
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise UsageError(f"{key}: a non-empty string (not {_kind(value) if value != '' else 'an empty one'})")
    return value


def _cursor(raw: str) -> dict[str, Any]:
    """The ``cursor`` a logs answer gave, read back and checked: ``{"segment": N|null, "offsets":
    {"FILE": BYTES}}``; anything else is a 400 (it came from the page, or from anyone with the token)."""
    shape = 'the "cursor" object the last answer gave: {"segment": N, "offsets": {"FILE": BYTES, ...}}'
    try:
        cursor = json.loads(raw)
    except (ValueError, RecursionError):
        raise UsageError(f"cursor: not JSON; expected {shape}") from None
    if not isinstance(cursor, dict):
        raise UsageError(f"cursor: {_kind(cursor)}; expected {shape}")
    segment, offsets = cursor.get("segment"), cursor.get("offsets")
    if segment is not None and (type(segment) is not int or segment < 1):
        raise UsageError(f"cursor: segment is {_kind(segment)}, not a segment number; expected {shape}")
    if offsets is None:
        offsets = {}
    if not isinstance(offsets, dict) or not all(
        isinstance(k, str) and type(v) is int and v >= 0 for k, v in offsets.items()
    ):
        raise UsageError(f"cursor: offsets must map each file to a byte offset; expected {shape}")
    return {"segment": segment, "offsets": offsets}


def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(request.get_data(as_text=True) or "{}")
    except (ValueError, RecursionError):
        raise UsageError("the body is not JSON") from None
    if not isinstance(body, dict):
        raise UsageError("the body is not a JSON object")
    return body


def _json(value: Any, status: int = 200) -> Response:
    return Response(json.dumps(value, default=str), status=status, mimetype="application/json")


class _QuietHandler(WSGIRequestHandler):
    """No line per request: each would print the URL, and the first carries the token."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass


def serve(app: App, port: int = 0) -> BaseWSGIServer:
    """A threaded server for ``app`` bound to 127.0.0.1:``port`` (0: a free port, which it then has)."""
    server = make_server(HOST, port, app, threaded=True, request_handler=_QuietHandler)
    app.port = server.server_port
    return server


def url(app: App) -> str:
    return f"http://{HOST}:{app.port}/?token={app.token}"


def run_in_thread(server: BaseWSGIServer) -> threading.Thread:
    """The server in a daemon thread (tests and the benchmark); ``server.shutdown()`` ends it."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread
