"""The two Ray Serve deployments and how they are started: EngineReplica (one engine, scheduler and pool each, serving
codespec's own FastAPI app in-process) and Gateway (the HTTP ingress: reads the request once for its routing key,
relays it to a replica through a deployment handle, streams the answer back, retries a replica that died before
answering). See codespec/replicas/__init__.py for the design.

No `from __future__ import annotations` here: serve.ingress rebuilds the routes' signatures, and FastAPI must see
`Request` as a class, not a string."""

import asyncio
import json
import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from starlette.responses import Response

from ..config import ModelConfig, SamplingParams, ServerConfig, SpecConfig
from .routing import Hint, merge_metrics, request_hint

APP = "codespec"
ENGINE, GATEWAY = "CodespecEngine", "CodespecGateway"
REPLICA_HEADER = "x-codespec-replica"  # every relayed answer says which replica served it
RETRIES = 2  # a request whose replica died before answering is sent again this many times
REPLICA_GONE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
OBJECT_STORE_BYTES = 100 << 20  # a local Ray's shared-memory object store: requests and answers are small
log = logging.getLogger("codespec.replicas")


@dataclass
class ReplicaSettings:
    model: ModelConfig
    spec: SpecConfig
    params: SamplingParams
    server: ServerConfig
    model_name: str = "codespec"
    model_aliases: tuple = ()
    threads: int = 1  # torch threads per replica (= its CPUs)
    cache_reuse: int = 0  # --cache-reuse, where this codespec has it


@serve.deployment(name=ENGINE)
class EngineReplica:
    """One codespec engine behind codespec's own app (create_app): the same routes, limits, keys and metrics as
    `codespec serve`, each request handed to the app as ASGI messages."""

    def __init__(self, settings: ReplicaSettings):
        import torch

        from ..engine import Engine
        from ..cli.memory import return_freed_memory
        from ..server import create_app

        return_freed_memory()
        torch.set_num_threads(max(1, settings.threads))
        engine = Engine.load(settings.model, settings.spec, show_progress=False)
        if settings.cache_reuse:
            engine.cache_reuse = settings.cache_reuse
        self.app = create_app(engine, settings.server, settings.params, settings.spec, model_name=settings.model_name,
                              model_aliases=settings.model_aliases)
        self.id = serve.get_replica_context().replica_id.unique_id

    async def http(self, scope: dict, body: bytes, route: Hint | None = None):
        """The app's answer to one request: first {"status", "headers"}, then the body's pieces as they are sent.
        When the caller goes away (the generator is closed or cancelled) the app sees the client disconnect, so a
        generation stops at its next step."""
        messages: asyncio.Queue = asyncio.Queue()
        body_taken, gone = False, asyncio.Event()

        async def receive():
            nonlocal body_taken
            if not body_taken:
                body_taken = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await messages.put(message)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.id.encode())]
                    yield {"status": message["status"], "headers": headers}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        return
            task.result()  # the app ended without answering: its error
        finally:
            gone.set()

    async def info(self, route: Hint | None = None) -> dict:
        """This replica's identity and load (the gateway's /replicas)."""
        import ray

        scheduler, engine = self.app.state.scheduler, self.app.state.engine
        return {"replica": self.id, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "sessions": len(engine.sessions), "queued": scheduler.queued, "active": scheduler.active}

    def __del__(self):
        app = getattr(self, "app", None)
        if app is not None:
            app.state.scheduler.close()


gateway_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # /docs, /openapi.json: a replica's


def error(status: int, message: str, kind: str) -> Response:
    """codespec's error shape (codespec/server/errors.py)."""
    body = {"error": {"code": status, "message": message, "type": kind}}
    return Response(json.dumps(body), status_code=status, media_type="application/json")


def asgi_scope(request: Request) -> dict:
    """The request's ASGI scope as plain data for another process (no app, router or state objects)."""
    scope = request.scope
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": scope.get("http_version", "1.1"), "method": scope["method"], "scheme": scope["scheme"],
            "path": scope["path"], "raw_path": scope.get("raw_path") or scope["path"].encode(), "root_path": "",
            "query_string": scope.get("query_string", b""), "headers": list(scope["headers"]),
            "client": tuple(scope["client"]) if scope.get("client") else None,
            "server": tuple(scope["server"]) if scope.get("server") else None}


class Relayed(Response):
    """A replica's answer, sent on as it arrives. A replica that dies mid-answer ends a stream of server-sent events
    with an error event (and [DONE] on OpenAI routes), as codespec ends a stream that fails; any other answer is
    cut short, which its declared length makes visible. A client that leaves cancels the replica's request."""

    def __init__(self, start: dict, rest, path: str):
        self.status_code, self.raw_headers = start["status"], [tuple(h) for h in start["headers"]]
        self.background, self.rest, self.path = None, rest, path

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pump = asyncio.ensure_future(self.pump(send))
        watch = asyncio.ensure_future(disconnected(receive))
        try:
            done, _ = await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            if pump in done:
                pump.result()
        finally:
            for task in (pump, watch):
                task.cancel()
            self.rest.cancel()

    async def pump(self, send):
        streamed = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in self.raw_headers)
        try:
            async for chunk in self.rest:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except REPLICA_GONE as exc:
            if not streamed:
                raise
            log.warning("a replica died while streaming %s: %s", self.path, type(exc).__name__)
            event = {"error": {"code": 503, "message": "the replica serving this request stopped; send it again "
                                                       "(another replica will rebuild the session's cache)",
                               "type": "replica_error"}}
            tail = f"data: {json.dumps(event)}\n\n" + ("data: [DONE]\n\n" if self.path.startswith("/v1/") else "")
            await send({"type": "http.response.body", "body": tail.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@serve.deployment(name=GATEWAY, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(gateway_app)
class Gateway:
    def __init__(self, engine, max_request_bytes: int = ServerConfig.max_request_bytes, api_keys: tuple = ()):
        self.engine, self.max_request_bytes, self.api_keys = engine, max_request_bytes, tuple(api_keys)

    async def call(self, scope: dict, body: bytes, hint: Hint):
        """The first message of a replica's answer and the rest of it; a replica that dies before answering is
        replaced by another (the session's cache is rebuilt there from this request's prompt)."""
        problem = "no replica"
        for attempt in range(RETRIES + 1):
            answer = self.engine.options(stream=True, session_id=hint.session or "").http.remote(scope, body,
                                                                                                  route=hint)
            try:
                return await answer.__anext__(), answer
            except REPLICA_GONE as exc:
                problem = type(exc).__name__
                log.warning("a replica died before answering %s (try %d): %s", scope["path"], attempt + 1, problem)
                await asyncio.sleep(0.2 * (attempt + 1))
            except BackPressureError as exc:
                return {"error": error(429, f"every replica is busy: {exc}", "rate_limit_error")}, None
        return {"error": error(503, f"no replica could answer ({problem}) after {RETRIES + 1} tries; the service "
                                    "is restarting replicas", "server_error")}, None

    @gateway_app.get("/metrics")
    async def metrics(self, request: Request):
        """Every replica's Prometheus metrics, each sample labelled replica="ID", and the gateway's routing counts
        (codespec_replica_routes_total by reason)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from .live import REGISTRY

        answers = await self.fan_out(request)
        if isinstance(answers, Response):
            return answers
        text = merge_metrics({rid: body.decode() for rid, body in answers.items()}) + generate_latest(REGISTRY)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @gateway_app.get("/slots")
    async def slots(self, request: Request):
        """Every replica's named sessions, each with the replica that holds it."""
        answers = await self.fan_out(request)
        if isinstance(answers, Response):
            return answers
        rows = [{**row, "replica": rid} for rid, body in answers.items() for row in json.loads(body)]
        rows = [{**row, "id": index} for index, row in enumerate(rows)]  # (each replica numbers its own from 0)
        return Response(json.dumps(rows), media_type="application/json")

    @gateway_app.get("/replicas")
    async def replicas(self, request: Request):
        """Each live replica: its id, process id, node, sessions and load (the API key is needed, as for /slots)."""
        if self.api_keys and not self.authorized(request):
            return error(401, "missing or wrong API key (Authorization: Bearer KEY or X-Api-Key: KEY)",
                         "authentication_error")
        infos = []
        for rid in await self.replica_ids():
            try:
                info = await asyncio.wait_for(self.engine.info.remote(route=Hint(pin=rid)), 30)
            except (asyncio.TimeoutError, *REPLICA_GONE):
                continue
            if info["replica"] == rid:
                infos.append(info)
        return Response(json.dumps(infos), media_type="application/json")

    @gateway_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def forward(self, request: Request, path: str):
        """Every other route, answered by the replica the policy picks (routing.py)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            return error(413, f"the request body is over {self.max_request_bytes} bytes", "invalid_request_error")
        body = await request.body()
        hint = request_hint(request.url.path, request.headers, body)
        start, rest = await self.call(asgi_scope(request), body, hint)
        if rest is None:
            return start["error"]
        return Relayed(start, rest, request.url.path)

    async def fan_out(self, request: Request) -> dict[str, bytes] | Response:
        """The same GET to every live replica: their bodies by replica id, or the first answer that is not a 200
        (a missing API key is refused by every replica alike)."""
        scope = asgi_scope(request)
        answers = {}
        for rid in await self.replica_ids():
            start, rest = await self.call(scope, b"", Hint(pin=rid))
            if rest is None:
                continue
            body = b"".join([chunk async for chunk in rest])
            headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
            if start["status"] != 200:
                return Response(body, status_code=start["status"], media_type=headers.get("content-type"))
            if headers.get(REPLICA_HEADER) == rid:  # the pinned replica itself, not one standing in for it
                answers[rid] = body
        return answers

    async def replica_ids(self) -> list[str]:
        from .live import live_replicas

        deadline = time.monotonic() + 30
        while not (ids := live_replicas()) and time.monotonic() < deadline:
            try:  # the handle's router starts with the first request through it
                await asyncio.wait_for(self.engine.info.remote(), 30)
            except (asyncio.TimeoutError, *REPLICA_GONE):
                await asyncio.sleep(0.5)
        return ids

    def authorized(self, request: Request) -> bool:
        """`Authorization: Bearer KEY` or `X-Api-Key: KEY`, as the replicas' own check (server/middleware.py)."""
        given = [request.headers.get("authorization", "").removeprefix("Bearer ").strip().encode(),
                 request.headers.get("x-api-key", "").strip().encode()]
        return any([secrets.compare_digest(sent, key.encode()) for key in self.api_keys for sent in given])


def build_app(args, replicas: int):
    """The Serve application for parsed `codespec serve` arguments (codespec/cli/options.py)."""
    from ..cli.options import served_names, server_config, settings_from_args

    model, spec, params = settings_from_args(args)
    server = server_config(args)
    name, aliases = served_names(model.model, getattr(args, "alias", ()))
    cpus = args.replica_cpus
    settings = ReplicaSettings(model, spec, params, server, name, tuple(aliases), threads=max(1, round(cpus)),
                               cache_reuse=getattr(args, "cache_reuse", 0) or 0)
    engine = EngineReplica.options(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus, "num_gpus": args.replica_gpus},
        # a replica takes its turns and its queue; past that Serve holds requests back (429 past max_queued)
        max_ongoing_requests=server.parallel + server.max_queue, max_queued_requests=server.max_queue,
        request_router_config=RequestRouterConfig(request_router_class="codespec.replicas.router.SessionRouter",
                                                  request_router_kwargs={"spill_at": server.parallel}),
        health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=5,
    ).bind(settings)
    keys = tuple(key for key in (server.api_key or "").split(",") if key)
    return Gateway.bind(engine, server.max_request_bytes, keys)


def app_builder(args: dict):
    """For `serve run codespec.replicas:app_builder replicas=2 model=... ` and Serve config files: the same options
    as `codespec serve` (names with dashes or underscores)."""
    from ..cli.options import build_parser

    argv = ["serve"] + [f"--{key.replace('_', '-')}={value}" for key, value in args.items() if key != "replicas"]
    return build_app(build_parser().parse_args(argv), int(args.get("replicas", 2)))


def run_replicas(args) -> int:
    """`codespec serve --replicas N`: a local Ray (or the cluster at --ray-address), Serve's HTTP proxy on --host and
    --port, N engine replicas behind the gateway; until interrupted."""
    import signal

    import ray

    from ..errors import CodespecError

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    app = build_app(args, args.replicas)
    local = not args.ray_address
    try:
        if local:
            cpus = max(os.cpu_count() or 1, int(args.replicas * args.replica_cpus + 0.999))
            ray.init(num_cpus=cpus, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
                     logging_level=logging.WARNING, log_to_driver=False)
        else:
            ray.init(address=args.ray_address, logging_level=logging.WARNING, log_to_driver=False)
    except Exception as exc:  # Ray's own messages say what is wrong (address, resources)
        raise CodespecError(f"cannot start Ray: {exc}") from exc

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config={"log_level": "WARNING"})
        serve.run(app, name=APP, route_prefix="/", blocking=False)
        print(f"codespec: serving {args.replicas} replicas on Ray Serve at http://{args.host}:{args.port} "
              f"(/infill, /v1/completions, /v1/chat/completions, /metrics, /slots, /replicas)", file=sys.stderr,
              flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        raise CodespecError(f"cannot serve replicas: {exc}") from exc
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            serve.shutdown() if local else serve.delete(APP)
        finally:
            ray.shutdown()
    return 0
