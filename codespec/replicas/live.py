"""State the gateway process shares with its request routers. Serve pickles a custom router's module by value (a
copy of its globals in each process that routes), so what both must see lives here, in a module router.py only
refers to."""

from __future__ import annotations

import threading
import weakref

from prometheus_client import CollectorRegistry, Counter

REGISTRY = CollectorRegistry()  # merged into the gateway's /metrics
ROUTES = Counter("codespec_replica_routes", "requests routed to a replica, by why it was chosen: session (the "
                 "session's replica), spill (its replica was saturated), prefix (where its prompt prefix went), "
                 "least-loaded, pinned (fan-out)", ["reason"], registry=REGISTRY)
routers: weakref.WeakSet = weakref.WeakSet()
lock = threading.Lock()


def add_router(router) -> None:
    with lock:
        routers.add(router)


def live_replicas() -> list[str]:
    """The replica ids this process's routers know (empty until the first request through a handle made one)."""
    with lock:
        current = list(routers)
    return sorted({replica for router in current for replica in router.replica_ids()})
