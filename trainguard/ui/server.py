"""The HTTP server: routes, the checks before them (:class:`~trainguard.ui.access.Access`),
the reader beside it (:class:`UiServer`), and ``trainguard ui`` itself (:func:`main`)."""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson

from trainguard.core.kafka import KafkaSettings
from trainguard.sinks.reports import attr as _attr
from trainguard.streams.rules import RuleSet
from trainguard.ui.access import SECURITY_HEADERS, TOKEN_COOKIE, Access, is_loopback
from trainguard.ui.pages import html_page, render_index, render_report_page, render_run
from trainguard.ui.reader import Board, Follower

log = logging.getLogger("trainguard.ui")

REQUEST_TIMEOUT_S = 10.0
"""A client has this long to send its request (and at most this long between two reads or
writes of the answer); then the connection is closed and its thread freed."""
MAX_CONNECTIONS = 64
"""Connections served at once (a browser opens about six); past it a connection gets 503 at once."""
_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nRetry-After: 5\r\n"
         b"Connection: close\r\n\r\ntrainguard ui: too many connections at once; try again shortly\n")


class PageServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them, each given ``request_timeout_s``
    to send its whole request: a client that opens connections and sends nothing (or a byte at a
    time) cannot hold threads for ever nor take every thread."""

    daemon_threads = True

    def __init__(self, address, handler, *, max_connections: int = MAX_CONNECTIONS,
                 request_timeout_s: float = REQUEST_TIMEOUT_S):
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._reading: dict[socket.socket, float] = {}  # connection -> when its request must be in
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            try:
                request.setblocking(False)  # a full buffer is the client's problem, not this loop's
                request.send(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        with self._lock:
            self._reading[request] = time.monotonic() + self.request_timeout_s
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def request_read(self, request) -> None:
        """The handler has the whole request: the deadline for sending it no longer applies."""
        with self._lock:
            self._reading.pop(request, None)

    def _done(self, request) -> None:
        with self._lock:
            self._reading.pop(request, None)
        self._slots.release()

    def service_actions(self) -> None:
        # Called by serve_forever every poll interval: end connections still sending their
        # request past the deadline (a byte every few seconds defeats a per-read timeout alone).
        now = time.monotonic()
        with self._lock:
            late = [r for r, deadline in self._reading.items() if deadline < now]
            for r in late:
                del self._reading[r]
        for r in late:
            try:
                r.shutdown(socket.SHUT_RDWR)  # its thread's blocked read returns; it closes the rest
            except OSError:
                pass


def steps_range(query: str) -> tuple[int, int] | None:
    """The steps a run page shows, from ``?from=&to=`` (both whole steps, ``from`` below ``to``);
    None for the whole run. ValueError says what is wrong with them."""
    given = urllib.parse.parse_qs(query)
    if "from" not in given and "to" not in given:
        return None
    try:
        first, last = int(given["from"][0]), int(given["to"][0])
    except (KeyError, ValueError):
        raise ValueError("?from= and &to= take whole steps, both of them (e.g. ?from=0&to=500)") from None
    if not (-2**62 < first < last < 2**62):
        raise ValueError(f"?from={first}&to={last}: from must be below to")
    return first, last


def make_handler(board: Board, access: Access | None = None):
    gate = access or Access("127.0.0.1")
    errors_seen: set[str] = set()

    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S  # per read and write of this connection's socket

        def setup(self):
            super().setup()
            self.connection.settimeout(getattr(self.server, "request_timeout_s", REQUEST_TIMEOUT_S))

        def parse_request(self) -> bool:
            done = super().parse_request()
            if hasattr(self.server, "request_read"):
                self.server.request_read(self.connection)
            return done

        def do_GET(self):  # noqa: N802 - the http.server name
            self._cookie = None
            if not gate.host_allowed(self.headers.get("Host")):
                return self._send(403, f"trainguard ui: this server does not answer to Host "
                                       f"{self.headers.get('Host')!r}; add the name to TRAINGUARD_UI_ALLOWED_HOSTS\n",
                                  "text/plain; charset=utf-8")
            split = urllib.parse.urlsplit(self.path)
            allowed, set_cookie = gate.token_given(split.query, self.headers.get("Cookie"))
            if not allowed:
                return self._send(401, "trainguard ui: this page needs its token: open the address `trainguard ui` "
                                       "printed (it ends in ?token=...), or set TRAINGUARD_UI_TOKEN\n",
                                  "text/plain; charset=utf-8")
            if set_cookie:
                self._cookie = f"{TOKEN_COOKIE}={gate.token}; Path=/; HttpOnly; SameSite=Strict"
            try:
                return self._route([urllib.parse.unquote(p) for p in split.path.split("/") if p], split.query)
            except Exception as exc:  # a page that cannot be built: say so, keep serving the others
                cause = type(exc).__name__
                if cause not in errors_seen:
                    errors_seen.add(cause)
                    log.warning("trainguard ui: could not render %s: %r", self.path[:200], exc, exc_info=True)
                return self._send(500, f"trainguard ui: this page could not be built ({cause}); the others are "
                                       f"served\n", "text/plain; charset=utf-8")

        def _route(self, parts: list[str], query: str = ""):
            if not parts:
                return self._send(200, render_index(board))
            if len(parts) == 2 and parts[0] == "run":
                try:
                    x_range = steps_range(query)
                except ValueError as exc:
                    return self._send(400, f"trainguard ui: {exc}\n", "text/plain; charset=utf-8")
                view = board.snapshot(parts[1])
                if view is not None:
                    return self._send(200, render_run(board, parts[1], view, x_range=x_range))
            if len(parts) == 4 and parts[0] == "run" and parts[2] == "report":
                page = render_report_page(board, parts[1], parts[3])
                if page is not None:
                    return self._send(200, page)
            if len(parts) == 3 and parts[:2] == ["api", "run"]:
                return self._send(200, orjson.dumps(board.run(parts[2]), default=str), "application/json")
            if parts == ["api", "runs"]:
                return self._send(200, orjson.dumps([r["run_id"] for r in board.runs()]), "application/json")
            return self._send(404, html_page("not found", f'<p>nothing at {_attr(self.path)}; <a href="/">all runs</a>'
                                                      f'</p>', refresh=False))

        def _send(self, code: int, body, content_type: str = "text/html; charset=utf-8") -> None:
            data = body.encode() if isinstance(body, str) else body
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in SECURITY_HEADERS:
                self.send_header(name, value)
            if self._cookie:
                self.send_header("Set-Cookie", self._cookie)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    return Handler


class UiServer:
    """The page server and its reader; ``port`` 0 picks a free one (``url`` says which).
    Bound beyond loopback, it needs a token: ``token``, else one made here (``login_url``
    carries it). ``allowed_hosts``: more names the ``Host`` header may give."""

    def __init__(self, settings: KafkaSettings, rules: RuleSet, *, addr: str = "127.0.0.1", port: int = 8321,
                 allowed_hosts=(), token: str | None = None, **board_limits):
        if token is None and not is_loopback(addr):
            token = secrets.token_urlsafe(24)
        self.token = token
        self.board = Board(rules, settings.topics, **board_limits)
        self.follower = Follower(settings, self.board)
        self.access = Access(addr, allowed_hosts=allowed_hosts, token=token)
        self.server = PageServer((addr, port), make_handler(self.board, self.access))
        shown = "127.0.0.1" if addr in ("", "0.0.0.0") else f"[{addr}]" if ":" in addr else addr
        self.url = f"http://{shown}:{self.server.server_address[1]}/"
        self.login_url = self.url + (f"?token={urllib.parse.quote(token)}" if token else "")
        self._thread = threading.Thread(target=self.server.serve_forever, name="trainguard-ui", daemon=True)

    def start(self) -> "UiServer":
        self.follower.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.follower.stop()


def main(args) -> int:
    from trainguard.core import settings as settings_mod
    from trainguard.streams import rules as rules_mod

    settings = KafkaSettings.from_env(bootstrap=args.bootstrap)
    try:
        ruleset = rules_mod.load(args.rules)
    except rules_mod.RulesError as exc:
        print(f"trainguard ui: bad rules file: {exc}")
        return 2
    hosts = (settings_mod.value("TRAINGUARD_UI_ALLOWED_HOSTS") or "").split(",")
    token = settings_mod.value("TRAINGUARD_UI_TOKEN") or None
    try:
        ui = UiServer(settings, ruleset, addr=args.addr, port=args.port, allowed_hosts=hosts, token=token).start()
    except OSError as exc:
        print(f"trainguard ui: cannot serve on {args.addr}:{args.port}: {exc} (another --port?)")
        return 2
    except Exception as exc:  # the broker cannot be reached
        print(f"trainguard ui: cannot read the topics at {settings.bootstrap}: {exc}; is `trainguard broker` "
              f"(or your Kafka) running, and TRAINGUARD_BOOTSTRAP set?")
        return 2
    if ui.follower.missing:
        print(f"trainguard ui: no topic {', '.join(ui.follower.missing)} yet (shown once a worker creates it "
              f"and the page is restarted)")
    if ui.token and token is None:
        print(f"trainguard ui: bound to {args.addr}, beyond loopback: pages need this token (made now; set "
              f"TRAINGUARD_UI_TOKEN to choose one). Pages answer to Host {', '.join(sorted(ui.access.hosts))} "
              f"(more: TRAINGUARD_UI_ALLOWED_HOSTS)")
    print(f"trainguard ui: {ui.login_url} (runs from {settings.bootstrap}; Ctrl-C to stop)", flush=True)
    try:
        last = -1
        while True:
            time.sleep(10)
            records, runs = ui.board.records, len(ui.board.runs())
            if records != last:
                skipped = ui.board.decoder.summary()
                print(f"trainguard ui: {records} records read, {runs} runs" + (f"; {skipped}" if skipped else ""),
                      flush=True)
                last = records
    except KeyboardInterrupt:
        pass
    finally:
        ui.stop()
    return 0
