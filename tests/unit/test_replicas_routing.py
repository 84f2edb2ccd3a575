"""The replica routing policy (codespec/replicas/routing.py) as pure functions: consistent hashing, spill, prefix
affinity, the routing key of a request, and the merged metrics."""

import json
from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from codespec.replicas.routing import (HashRing, Hint, PrefixIndex, SessionTable, merge_metrics, prefix_hashes,
                                       rank_replicas, request_hint)

REPLICAS = ["r-a", "r-b", "r-c"]
SESSIONS = [f"session-{i}" for i in range(3000)]


def test_ring_is_deterministic_and_spreads_sessions():
    ring = HashRing(REPLICAS)
    again = HashRing(list(reversed(REPLICAS)))
    owners = [ring.owner(s) for s in SESSIONS]
    assert owners == [again.owner(s) for s in SESSIONS]  # another process or router agrees
    counts = Counter(owners)
    assert set(counts) == set(REPLICAS)
    assert max(counts.values()) < 1.35 * len(SESSIONS) / len(REPLICAS)  # within about a third of even
    assert ring.successors("x")[0] == ring.owner("x") and sorted(ring.successors("x")) == sorted(REPLICAS)


def test_losing_a_replica_moves_only_its_sessions():
    before = HashRing(REPLICAS)
    after = HashRing(["r-a", "r-c"])
    for session in SESSIONS:
        if before.owner(session) != "r-b":
            assert after.owner(session) == before.owner(session)
        else:  # its sessions go to the next replica on the ring, which is the old first fallback
            assert after.owner(session) == before.successors(session)[1]
    grown = HashRing([*REPLICAS, "r-d"])
    moved = [s for s in SESSIONS if grown.owner(s) != before.owner(s)]
    assert all(grown.owner(s) == "r-d" for s in moved)
    assert 0.15 < len(moved) / len(SESSIONS) < 0.35  # about a quarter: the new replica's share


def test_session_goes_home_then_spills_to_least_loaded_when_saturated():
    ring = HashRing(REPLICAS)
    home = ring.owner("editor-1")
    others = [r for r in REPLICAS if r != home]
    idle = {r: 0 for r in REPLICAS}
    route = rank_replicas(REPLICAS, idle, Hint(session="editor-1"), spill_at=4, ring=ring)
    assert (route.reason, route.home, route.ranks[0]) == ("session", home, [home])
    assert sorted(route.ranks[1]) == sorted(others)  # Ray tries them only if the home refuses (full)
    busy = {home: 4, others[0]: 3, others[1]: 1}
    route = rank_replicas(REPLICAS, busy, Hint(session="editor-1"), spill_at=4, ring=ring)
    assert route.reason == "spill" and sorted(route.ranks[0]) == sorted(others) and route.ranks[1] == [home]
    below = {home: 3, others[0]: 0, others[1]: 0}  # busy but not saturated: stays home
    assert rank_replicas(REPLICAS, below, Hint(session="editor-1"), spill_at=4, ring=ring).ranks[0] == [home]
    everyone = {r: 9 for r in REPLICAS}  # all saturated: moving would only lose the cache
    assert rank_replicas(REPLICAS, everyone, Hint(session="editor-1"), spill_at=4, ring=ring).reason == "session"


def test_bounded_loads_spread_a_few_sessions_and_stay_sticky():
    two = ["r-a", "r-b"]
    ring = HashRing(two)
    worst = 0
    for trial in range(200):  # many sets of 8 session names: plain hashing puts 7 or 8 on one replica in ~7% of them
        names = [f"t{trial}-editor-{i}" for i in range(8)]
        table = SessionTable()
        homes = [table.home(name, ring, now=0.0) for name in names]
        worst = max(worst, max(Counter(homes).values()))
        assert [table.home(name, ring, now=1.0) for name in names] == homes  # sticky
    assert worst <= 5  # ceil(1.25 * 8 / 2)
    plain = [max(Counter(ring.owner(f"t{t}-editor-{i}") for i in range(8)).values()) for t in range(200)]
    assert max(plain) >= 7  # what the bound prevents


def test_session_table_moves_only_a_dead_replicas_sessions_and_forgets_idle_ones():
    ring = HashRing(REPLICAS)
    table = SessionTable()
    names = [f"s{i}" for i in range(30)]
    homes = {name: table.home(name, ring, now=0.0) for name in names}
    survivors = HashRing(["r-a", "r-c"])
    after = {name: table.home(name, survivors, now=1.0) for name in names}
    for name in names:
        if homes[name] != "r-b":
            assert after[name] == homes[name]
        else:
            assert after[name] in ("r-a", "r-c")
    grown = HashRing([*REPLICAS, "r-d"])  # a replacement or a new replica: active sessions stay where they are
    assert {name: table.home(name, grown, now=2.0) for name in names} == after
    assert table.sessions_of("r-d") == [] and table.home("new-one", grown, now=2.0) == "r-d"  # it takes new ones
    idle = SessionTable(idle_seconds=10)
    idle.home("old", ring, now=0.0)
    idle.home("fresh", ring, now=20.0)
    assert len(idle) == 1


def test_rank_replicas_uses_the_session_table():
    ring = HashRing(REPLICAS)
    table = SessionTable()
    route = rank_replicas(REPLICAS, {}, Hint(session="x"), spill_at=4, ring=ring, table=table, now=0.0)
    assert route.home == table.home("x", ring, now=0.0) and route.ranks[0] == [route.home]
    assert sorted(route.ranks[1]) == sorted(r for r in REPLICAS if r != route.home)


def test_unknown_loads_count_as_idle_and_a_stale_ring_is_not_used():
    ring = HashRing(["r-a", "r-b", "r-c", "r-gone"])
    route = rank_replicas(REPLICAS, {}, Hint(session="s"), spill_at=1, ring=ring)
    assert route.home == HashRing(REPLICAS).owner("s") and route.reason == "session"


def test_prefix_affinity_and_least_loaded():
    text = "def f(x):\n    return x\n" * 200
    index = PrefixIndex()
    first = rank_replicas(REPLICAS, {}, Hint(prefix=prefix_hashes(text)), spill_at=4, index=index)
    assert first.reason == "least-loaded" and sorted(first.ranks[0]) == sorted(REPLICAS)  # Ray picks the lowest
    index.record(prefix_hashes(text), "r-b")
    longer = text + "def g(y):\n    return y\n" * 40  # the same file, typed further
    route = rank_replicas(REPLICAS, {}, Hint(prefix=prefix_hashes(longer)), spill_at=4, index=index)
    assert (route.reason, route.ranks[0]) == ("prefix", ["r-b"])
    assert rank_replicas(REPLICAS, {"r-b": 4}, Hint(prefix=prefix_hashes(longer)), 4, index=index).reason == \
        "least-loaded"  # its replica saturated
    index.record(prefix_hashes(longer), "r-c")  # the longer prefix went elsewhere since: the longest match wins
    assert rank_replicas(REPLICAS, {}, Hint(prefix=prefix_hashes(longer + "z" * 300)), 4, index=index).home == "r-c"
    other = "class Other:\n    pass\n" * 200
    assert rank_replicas(REPLICAS, {}, Hint(prefix=prefix_hashes(other)), 4, index=index).reason == "least-loaded"
    assert rank_replicas(["r-a"], {}, Hint(prefix=prefix_hashes(longer)), 4, index=index).reason == "least-loaded"
    index.forget("r-c")  # it died: every block it was sent last is forgotten, shared ones too
    assert index.longest(prefix_hashes(longer), frozenset(REPLICAS)) == (None, 0)


def test_prefix_hashes_chain_and_index_is_bounded():
    a, b = "a" * 1000, "a" * 512 + "b" * 488
    assert len(prefix_hashes(a)) == 3 and len(prefix_hashes("x" * 255)) == 0  # whole blocks only
    assert prefix_hashes(a)[:2] == prefix_hashes(b)[:2] and prefix_hashes(a)[2] != prefix_hashes(b)[2]
    assert prefix_hashes("ab" * 128 + "c" * 256)[1] != prefix_hashes("c" * 256)[0]  # chained, not per block
    assert len(prefix_hashes("x" * 10**6)) == 64
    index = PrefixIndex(capacity=4)
    index.record([1, 2, 3], "r-a")
    index.record([4, 5], "r-b")
    assert len(index) == 4 and index.longest([1], frozenset(REPLICAS)) == (None, 0)  # the oldest forgotten


def test_pinned_requests_go_to_that_replica_only():
    assert rank_replicas(REPLICAS, {}, Hint(pin="r-c", session="s"), spill_at=1).ranks == [["r-c"]]
    assert rank_replicas(REPLICAS, {}, Hint(pin="r-gone"), spill_at=1).ranks == []
    assert rank_replicas([], {}, Hint(session="s"), spill_at=1).ranks == []


def test_request_hint_reads_session_slot_header_and_prompt():
    body = json.dumps
    assert request_hint("/infill", {}, body({"session": "doc-1", "id_slot": 3})) == Hint(session="doc-1")
    assert request_hint("/infill", {}, body({"id_slot": 3})) == Hint(session="slot-3")
    assert request_hint("/infill", {"x-session-id": "hdr"}, body({"id_slot": -1})) == Hint(session="hdr")
    assert request_hint("/infill", {"x-session-id": "hdr"}, body({"session": "doc"})).session == "doc"
    assert request_hint("/infill", {}, body({"session": "doc", "cache_prompt": False})) == Hint()
    assert request_hint("/infill", {}, b"not json") == Hint(prefix=[])
    assert request_hint("/health", {"x-session-id": "hdr"}, b"") == Hint(session="hdr")
    assert request_hint("/infill", {}, body({"id_slot": True})).session is None
    code = "import os\n" * 100
    infill = request_hint("/infill", {}, body({"input_prefix": code, "prompt": "x = ", "input_suffix": "zzz"}))
    assert infill.prefix and infill.prefix == prefix_hashes(code + "x = ")
    assert request_hint("/v1/completions", {}, body({"prompt": [code]})).prefix == prefix_hashes(code)
    chat = request_hint("/v1/chat/completions", {}, body({"messages": [{"role": "user", "content": code}]}))
    assert chat.prefix == prefix_hashes(f"user: {code}\n")


def test_merge_metrics_labels_every_sample_by_replica():
    one = ("# HELP codespec_queue_depth generations waiting\n# TYPE codespec_queue_depth gauge\n"
           "codespec_queue_depth 2.0\n# HELP codespec_requests_total HTTP requests\n"
           "# TYPE codespec_requests_total counter\ncodespec_requests_total{route=\"/infill\",status=\"200\"} 5.0\n")
    two = one.replace("2.0", "0.0").replace("5.0", "7.0")
    merged = {f.name: f for f in text_string_to_metric_families(merge_metrics({"r-a": one, "r-b": two}).decode())}
    queue = {s.labels["replica"]: s.value for s in merged["codespec_queue_depth"].samples}
    assert queue == {"r-a": 2.0, "r-b": 0.0}
    requests = {s.labels["replica"]: s.value for s in merged["codespec_requests"].samples}
    assert requests == {"r-a": 5.0, "r-b": 7.0}
