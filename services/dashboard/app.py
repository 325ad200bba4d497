"""The dashboard's HTTP surface (Starlette): decode the request, authenticate, call a read, render.

Every page but /login, /healthz and /static needs a token the store accepts; a browser without one is
sent to /login, a script (an Authorization header, or not asking for HTML) gets 401. Pages are
server-rendered with Jinja2 (autoescaped) and the charts are JSON drawn by the local plotly.js, so the
Content-Security-Policy allows no inline script.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.dashboard import auth, pages
from services.dashboard.reads import Backend, acting_as
from services.runtime.auth import Principal
from services.runtime.errors import BallastError, InvalidArgument, NotFound, PermissionDenied, Unauthenticated

HERE = Path(__file__).parent
HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",  # no-referrer would make a same-site form POST say Origin: null
}
MAX_FORM_BYTES = 4096  # a token and its field name, with room to spare
STATUS = {NotFound: 404, InvalidArgument: 400, PermissionDenied: 403, Unauthenticated: 401}
Render = Callable[[Request, Backend], tuple[str, dict[str, Any]]]


def plotly_js() -> Path:
    """plotly.min.js as the `plotly` package ships it (no CDN)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the plotly package is not installed; run `make install`")
    return Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"


class SecurityHeaders:
    """Adds HEADERS (and no-store on pages) to every response."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = scope["path"].startswith("/static/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [(k.encode(), v.encode()) for k, v in HEADERS.items()]
                if not static:
                    extra.append((b"cache-control", b"no-store"))
                message["headers"] = list(message.get("headers", [])) + extra
            await send(message)

        await self.app(scope, receive, send_with_headers)


def build_app(backend: Backend, secure: bool) -> Starlette:
    """The ASGI app over `backend`; `secure`: served over HTTPS (the cookie is then Secure)."""
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))
    env.filters.update(pages.FILTERS)

    def html(name: str, context: dict[str, Any], status: int = 200) -> HTMLResponse:
        return HTMLResponse(env.get_template(name).render(**context), status_code=status)

    def refuse(request: Request, scripted: bool, clear: bool) -> Response:
        if scripted or "text/html" not in request.headers.get("accept", ""):
            response: Response = PlainTextResponse("401 unauthenticated: send Authorization: Bearer TOKEN\n", 401,
                                                   headers={"www-authenticate": 'Bearer realm="ballast"'})
        else:
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            response = RedirectResponse(f"/login?next={quote(target, safe='/')}", status_code=303)
        if clear:
            response.delete_cookie(auth.COOKIE, path="/")
        return response

    def page(render: Render) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            token, scripted = auth.token_of(request.headers, request.cookies)
            if not token:
                return refuse(request, scripted, clear=False)
            try:
                principal: Principal = backend.authenticate(token)
            except Unauthenticated:
                return refuse(request, scripted, clear=not scripted)
            except BallastError as exc:
                return html("error.html", {"status": 503, "message": str(exc), "principal": None}, 503)
            for name, value in request.path_params.items():
                if not auth.valid_id(str(value)):
                    return html("error.html", {"status": 400, "message": f"{name}: not an id", "principal": principal},
                                400)
            request.state.principal = principal
            try:
                with acting_as(token):
                    template, context = render(request, backend)
            except BallastError as exc:
                status = next((s for kind, s in STATUS.items() if isinstance(exc, kind)), 503)
                return html("error.html", {"status": status, "message": str(exc), "principal": principal}, status)
            return html(template, {**context, "principal": principal, "path": request.url.path})

        return endpoint

    def login_form(request: Request) -> Response:
        return html("login.html", {"next": auth.safe_next(request.query_params.get("next", "/")), "error": ""})

    async def login(request: Request) -> Response:
        origin = request.headers.get("origin")
        if origin and origin.split("://", 1)[-1] != request.headers.get("host", ""):
            return PlainTextResponse("403 cross-site login refused\n", 403)
        target = auth.safe_next(request.query_params.get("next", "/"))
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                return PlainTextResponse(f"413 the login form takes at most {MAX_FORM_BYTES} bytes\n", 413)
        try:
            token = auth.login_token(body)
        except ValueError as exc:
            return html("login.html", {"next": target, "error": str(exc)}, 400)
        try:
            await _in_thread(backend.authenticate, token)
        except Unauthenticated:
            return html("login.html", {"next": target, "error": "the store does not know that token"}, 401)
        except BallastError as exc:
            return html("login.html", {"next": target, "error": f"cannot check the token now: {exc}"}, 503)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(auth.COOKIE, token, max_age=auth.COOKIE_MAX_AGE_S, path="/", httponly=True,
                            samesite="strict", secure=secure)
        return response

    def logout(request: Request) -> Response:
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(auth.COOKIE, path="/")
        return response

    routes = [
        Route("/", lambda request: RedirectResponse("/jobs", status_code=303)),
        Route("/healthz", lambda request: PlainTextResponse("ok\n")),
        Route("/login", login_form, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/jobs", page(pages.jobs_page)),
        Route("/jobs/{job_id}", page(pages.job_page)),
        Route("/queue", page(pages.queue_page)),
        Route("/fleet", page(pages.fleet_page)),
        Route("/plans", page(pages.plans_page)),
        Route("/plans/{plan_id}", page(pages.plan_page)),
        Route("/profiles", page(pages.profiles_page)),
        Route("/profiles/{profile_id}", page(pages.profile_page)),
        Route("/static/plotly.min.js", lambda request: FileResponse(plotly_js(), media_type="text/javascript")),
        Mount("/static", StaticFiles(directory=HERE / "static")),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(SecurityHeaders)
    return app


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args)
