"""Replicas on Ray Serve: `codespec serve --replicas N` runs N engines behind one HTTP address.

Design.
- Two deployments in one Serve application (deploy.py). EngineReplica: one engine with its own scheduler, sessions
  and ngram-mod pool, exactly `codespec serve`'s FastAPI app (create_app), which it answers in-process from ASGI
  messages, so every route, limit, API key, SSE stream and metric is the single server's. Gateway: the HTTP ingress
  (`serve.ingress`, a FastAPI app behind Serve's proxy); for each request it reads the body once, takes its routing
  key from it, and relays the request through a deployment handle (`options(stream=True, session_id=...)`) to the
  replica Serve's router picks, streaming the answer back piece by piece.
- Why a gateway at all: Serve's proxy routes by header only (X-Session-Id), but codespec's clients name sessions in
  the body (`session`, llama.cpp's `id_slot`) and an editor that names none is best kept near its prompt's prefix;
  only a deployment that has read the body can say either.
- The routing itself is a Serve request router (router.SessionRouter, a `ray.serve.request_router.RequestRouter`)
  configured on EngineReplica, applying the pure policy of routing.py to Serve's live replica set and its
  queue-length cache: a named session goes to its consistent-hash owner (spilling, for that request, to the least
  loaded replica when the owner has `--parallel` requests in flight); an unnamed one to where its longest prompt
  prefix went, else the least loaded. Serve's own machinery does the rest: probing queue lengths, trying the next
  rank when a replica is full (`max_ongoing_requests` = parallel + max-queue), 429 past `max_queued_requests`,
  dropping a dead replica and starting its replacement.
- Failure: a replica that dies loses only caches. A request it had not answered is sent again to another replica
  (up to 2 more times; the session's cache is rebuilt from the prompt there); a stream it had begun ends with an
  error event (code 503, type replica_error), never silently. The ring then maps its sessions to the survivors and,
  once Serve has started the replacement, partly to it (each move costs one prompt's prefill).
- State per replica: KV caches and sessions, drafter state, the ngram-mod pool, the scheduler and its queue, the
  Prometheus metrics. The gateway's /metrics merges every replica's, each sample labelled replica="ID", with its own
  routing counts (codespec_replica_routes_total by reason); /slots lists every replica's sessions with their
  replica; /replicas lists the replicas (id, pid, node, load). Every relayed answer names its replica in the
  X-Codespec-Replica header.
"""


def __getattr__(name):
    """`serve run codespec.replicas:app_builder ...` without importing Ray for the pure routing module."""
    if name in ("app_builder", "build_app", "run_replicas"):
        from . import deploy

        return getattr(deploy, name)
    raise AttributeError(name)
