"""Ray Serve's request router for the engine replicas: routing.rank_replicas applied to Serve's live replica set and
its queue-length cache. It runs inside the gateway's process (a handle's router lives with the handle), so the
gateway also reads the live replica ids from it for its fan-out routes (/metrics, /slots, /replicas). Serve pickles
this module by value into each routing process: shared state is live.py's, reached through the module."""

from __future__ import annotations

import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from . import live
from .routing import HashRing, Hint, PrefixIndex, SessionTable, rank_replicas


class SessionRouter(RequestRouter):
    """Session-affine routing with spill, prefix affinity and least-loaded placement (routing.py). The session
    key comes from the handle's `session_id` option, the prefix hashes and a pin from the call's `route` keyword
    argument (a Hint)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spill_at = 16
        self._ring = HashRing([])
        self._prefixes = PrefixIndex()
        self._sessions = SessionTable()
        self._decisions: dict[str, tuple[str, str | None, list[int]]] = {}  # request id -> reason, home, prefix
        live.add_router(self)

    def initialize_state(self, spill_at: int = 16, **kwargs) -> None:
        """From RequestRouterConfig.request_router_kwargs."""
        if not isinstance(spill_at, int) or spill_at < 1:
            raise ValueError(f"spill_at must be a positive int, got {spill_at!r}")
        self.spill_at = spill_at

    def replica_ids(self) -> list[str]:
        return [replica.unique_id for replica in list(self._replicas)]

    def _ring_for(self, ids: list[str]) -> HashRing:
        if self._ring.replicas != frozenset(ids):
            self._ring = HashRing(ids)
        return self._ring

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # every replica full: back off, then ask again
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        route_kwarg = pending_request.kwargs.get("route")
        hint = route_kwarg if isinstance(route_kwarg, Hint) else Hint()
        if pending_request.metadata.session_id and hint.session is None:
            hint = Hint(session=pending_request.metadata.session_id, pin=hint.pin)
        ids = sorted(by_id)
        loads = {rid: self._replica_queue_len_cache.get(replica.replica_id) for rid, replica in by_id.items()}
        route = rank_replicas(ids, loads, hint, self.spill_at, self._ring_for(ids), self._prefixes, self._sessions,
                              time.monotonic())
        self._decisions[pending_request.metadata.internal_request_id] = (route.reason, route.home, hint.prefix)
        if len(self._decisions) > 4096:  # requests cancelled before routing never reach on_request_routed
            self._decisions.pop(next(iter(self._decisions)))
        return [[by_id[rid] for rid in rank] for rank in route.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        reason, home, prefix = self._decisions.pop(pending_request.metadata.internal_request_id,
                                                   ("least-loaded", None, []))
        if reason in ("session", "prefix") and home is not None and replica_id.unique_id != home:
            reason = "spill"  # the home replica turned out full when Ray asked it
        live.ROUTES.labels(reason).inc()
        if prefix:
            self._prefixes.record(prefix, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._prefixes.forget(replica_id.unique_id)
