"""The replica routing policy as pure functions: no Ray here, so it is unit-tested on its own (router.py applies it
inside Ray Serve's request router; gateway.py extracts its inputs from the HTTP request).

- A request that names a session goes to the session's home replica: the owner on a consistent-hash ring (virtual
  nodes, so adding or losing a replica moves only that replica's share of the sessions), with bounded loads
  (Mirrokni, Thorup and Zadimoghaddam 2018): a new session skips, clockwise, replicas that already hold more than
  BALANCE times their share of the active sessions, so 8 editors on 2 replicas end up 4+4 or 5+3, never 7+1. A
  session keeps its home while it is active (SessionTable), also when a replica is added; only a dead replica's
  sessions move. When the home is saturated (`spill_at` requests in flight, all its engine's turns taken) and
  another replica is less loaded, the request spills to the least loaded one, for this request only.
- A request that names none goes where its prompt's longest prefix went before (a chained hash per block of the
  prompt text, looked up in a bounded index: a few microseconds), else to the least loaded replica.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

VIRTUAL_NODES = 100  # ring positions per replica: sessions spread within a few percent of even
PREFIX_BLOCK_CHARS = 256  # prompt text per prefix-hash block (about 64 tokens of code)
PREFIX_BLOCKS = 64  # blocks hashed per prompt: the first 16K characters decide where a prompt goes
PREFIX_INDEX_SIZE = 1 << 16  # block hashes remembered (least recently routed forgotten first)
BALANCE = 1.25  # a replica takes new sessions while it holds at most this many times its share of the active ones
SESSION_IDLE_SECONDS = 1800.0  # a session unused this long is no longer active (its home is forgotten)
SESSION_TABLE_SIZE = 1 << 16  # active sessions remembered (least recently used forgotten first)
SESSION_HEADER = "x-session-id"  # the header other gateways route sticky sessions by (Ray Serve, LiteLLM)


def stable_hash(data: bytes) -> int:
    """64 bits that are the same in every process and on every machine (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing: each replica owns VIRTUAL_NODES points; a key belongs to the first point clockwise."""

    def __init__(self, replicas: Sequence[str], virtual_nodes: int = VIRTUAL_NODES):
        points = sorted((stable_hash(f"{replica}#{i}".encode()), replica)
                        for replica in set(replicas) for i in range(virtual_nodes))
        self._hashes = [point for point, _ in points]
        self._owners = [replica for _, replica in points]
        self.replicas = frozenset(replicas)

    def successors(self, key: str) -> list[str]:
        """Every replica once, in ring order from the key's owner: [owner, first fallback, ...]."""
        if not self._hashes:
            return []
        start = bisect.bisect_right(self._hashes, stable_hash(key.encode()))
        order: list[str] = []
        for offset in range(len(self._hashes)):
            replica = self._owners[(start + offset) % len(self._hashes)]
            if replica not in order:
                order.append(replica)
                if len(order) == len(self.replicas):
                    break
        return order

    def owner(self, key: str) -> str | None:
        order = self.successors(key)
        return order[0] if order else None


class SessionTable:
    """Each active session's home replica: consistent hashing with bounded loads, sticky while the session is used."""

    def __init__(self, balance: float = BALANCE, idle_seconds: float = SESSION_IDLE_SECONDS,
                 capacity: int = SESSION_TABLE_SIZE):
        self.balance, self.idle_seconds, self.capacity = balance, idle_seconds, capacity
        self._homes: OrderedDict[str, tuple[str, float]] = OrderedDict()  # session -> (replica, last used)

    def __len__(self) -> int:
        return len(self._homes)

    def home(self, session: str, ring: HashRing, now: float) -> str | None:
        """The session's home among the ring's replicas, assigning one if it has none there (or its home died)."""
        known = self._homes.get(session)
        if known is not None and known[0] in ring.replicas:
            self._homes[session] = (known[0], now)
            self._homes.move_to_end(session)
            return known[0]
        self._homes.pop(session, None)
        while self._homes and (len(self._homes) >= self.capacity
                               or now - next(iter(self._homes.values()))[1] > self.idle_seconds):
            self._homes.popitem(last=False)
        held = Counter(replica for replica, _ in self._homes.values() if replica in ring.replicas)
        bound = math.ceil(self.balance * (sum(held.values()) + 1) / max(1, len(ring.replicas)))
        order = ring.successors(session)
        home = next((replica for replica in order if held[replica] < bound), order[0] if order else None)
        if home is not None:
            self._homes[session] = (home, now)
        return home

    def sessions_of(self, replica: str) -> list[str]:
        return [session for session, (where, _) in self._homes.items() if where == replica]


def prefix_hashes(text: str, block_chars: int = PREFIX_BLOCK_CHARS, max_blocks: int = PREFIX_BLOCKS) -> list[int]:
    """One hash per whole block of the text's start, each chained to the one before: equal hashes at depth d mean
    equal first d blocks. A trailing partial block is left out (it is still being typed)."""
    hashes, previous = [], b""
    for start in range(0, min(len(text), block_chars * max_blocks) - block_chars + 1, block_chars):
        digest = hashlib.blake2b(previous + text[start:start + block_chars].encode("utf-8", "surrogatepass"),
                                 digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "big"))
        previous = digest
    return hashes


class PrefixIndex:
    """Which replica each prompt-prefix block went to last; bounded, least recently routed forgotten first."""

    def __init__(self, capacity: int = PREFIX_INDEX_SIZE):
        self.capacity = capacity
        self._where: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def record(self, hashes: Sequence[int], replica: str) -> None:
        for block in hashes:
            self._where[block] = replica
            self._where.move_to_end(block)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def longest(self, hashes: Sequence[int], alive: frozenset[str] | set[str]) -> tuple[str | None, int]:
        """The live replica that was sent the longest of these prefixes, and how many blocks long it is."""
        for depth in range(len(hashes), 0, -1):
            replica = self._where.get(hashes[depth - 1])
            if replica is not None and replica in alive:
                return replica, depth
        return None, 0

    def forget(self, replica: str) -> None:
        for block in [block for block, where in self._where.items() if where == replica]:
            del self._where[block]


@dataclass
class Route:
    """Ranked choices for Ray Serve's router: it tries the first rank (the least loaded replica in it that is not
    full), then the next."""

    ranks: list[list[str]]
    reason: str  # session | spill | prefix | least-loaded | pinned
    home: str | None = None  # the replica the session or prefix belongs to


@dataclass
class Hint:
    """What the gateway learned from a request for routing it."""

    session: str | None = None  # the routing key of a named session
    prefix: list[int] = field(default_factory=list)  # prefix_hashes of its prompt
    pin: str | None = None  # one replica's id: fan-out requests (/metrics, /slots)


def rank_replicas(replicas: Sequence[str], loads: Mapping[str, int | None], hint: Hint, spill_at: int,
                  ring: HashRing | None = None, index: PrefixIndex | None = None, table: SessionTable | None = None,
                  now: float = 0.0) -> Route:
    """Where a request should go. `loads`: requests in flight per replica (None: not known, taken as idle). Without
    a SessionTable a session's home is its plain ring owner."""
    alive = list(dict.fromkeys(replicas))
    if not alive:
        return Route([], "least-loaded")

    def load(replica: str) -> int:
        return loads.get(replica) or 0

    if hint.pin is not None:
        return Route([[hint.pin]] if hint.pin in alive else [], "pinned", hint.pin)
    if hint.session is not None:
        ring = ring if ring is not None and ring.replicas == frozenset(alive) else HashRing(alive)
        order = ring.successors(hint.session)
        home = table.home(hint.session, ring, now) if table is not None else order[0]
        others = [r for r in order if r != home]
        lighter = [r for r in others if load(r) < load(home)]
        if load(home) >= spill_at and lighter:
            return Route([lighter, [home]], "spill", home)  # Ray picks the least loaded of the first rank
        return Route([[home], others] if others else [[home]], "session", home)
    if hint.prefix and index is not None:
        home, _ = index.longest(hint.prefix, frozenset(alive))
        if home is not None and load(home) < spill_at:
            others = [r for r in alive if r != home]
            return Route([[home], others] if others else [[home]], "prefix", home)
    return Route([alive], "least-loaded")


def request_hint(path: str, headers: Mapping[str, str], body: bytes) -> Hint:
    """The routing inputs of an HTTP request: the session it names (`session`, llama.cpp's `id_slot` N as
    "slot-N", else an X-Session-Id header) and, naming none, the prefix hashes of its prompt. `cache_prompt: false`
    asks for no cache, so nothing to be near. A body that is not JSON is routed least loaded (the replica answers
    its 400)."""
    header = headers.get(SESSION_HEADER) or None
    try:
        data = json.loads(body) if body else {}
    except (ValueError, UnicodeDecodeError):
        data = {}
    if not isinstance(data, dict):
        return Hint(session=header)
    if data.get("cache_prompt") is False:
        return Hint()
    session, slot = data.get("session"), data.get("id_slot")
    if isinstance(session, str):
        return Hint(session=session)
    if isinstance(slot, int) and not isinstance(slot, bool) and slot >= 0:
        return Hint(session=f"slot-{slot}")
    if header:
        return Hint(session=header)
    return Hint(prefix=prefix_hashes(prompt_text(path, data)))


def prompt_text(path: str, data: dict) -> str:
    """The request's prompt text in the order the replica lays its prompt out (other files' chunks first for
    /infill), as far as it is cheap to tell without the tokenizer."""
    def text(value) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return "".join(text(item) for item in value)
        if isinstance(value, dict):
            return text(value.get("text", value.get("content", "")))
        return ""

    if path.rstrip("/") == "/infill":
        chunks = data.get("input_extra") if isinstance(data.get("input_extra"), list) else []
        extra = "".join(f"{c.get('filename', '')}\n{text(c.get('text'))}" for c in chunks if isinstance(c, dict))
        return extra + text(data.get("filename")) + text(data.get("input_prefix")) + text(data.get("prompt"))
    if path.rstrip("/") == "/v1/chat/completions":
        messages = data.get("messages") if isinstance(data.get("messages"), list) else []
        return "".join(f"{m.get('role', '')}: {text(m.get('content'))}\n" for m in messages if isinstance(m, dict))
    return text(data.get("prompt"))


def merge_metrics(expositions: Mapping[str, str]) -> bytes:
    """Prometheus text from several replicas as one exposition, each sample labelled replica="ID"."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Metric] = {}
    for replica, text in expositions.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples.extend(Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                                  for s in family.samples)

    class Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())
    return generate_latest(registry)
