"""Replicas under load: --clients concurrent llama.vim-shaped editing sessions against `codespec serve --replicas N`
(Ray Serve on this machine), for each N in --replicas, each on a fresh service. Run it as
`python -m codespec.bench.replicas` (not a timed test).

Each session holds one cursor position of textwrap.py (server_load.positions): its context is warmed first
(`n_predict: 0`, untimed), then it asks for n_predict tokens, accepts the completion's first line and asks again
(--rounds times), all sessions at once. Reported per N: tokens/s (all sessions' generated tokens / wall time),
p50/p95 latency, failed requests, and session affinity: the share of requests answered by the replica that served
the session's previous request (its cache), read from each answer's X-Codespec-Replica header.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from .server_load import metric_lines, percentile, positions, serve, write_report


def sessions_run(client: httpx.Client, bodies: list[dict], n_predict: int, rounds: int) -> dict:
    """All sessions at once; what each request got and where."""
    homes = {}
    for index, body in enumerate(bodies):  # the cursor settles: warm the session's cache (untimed)
        answer = client.post("/infill", json={**body, "n_predict": 0, "session": f"client-{index}"})
        answer.raise_for_status()
        homes[index] = answer.headers.get("x-codespec-replica")

    def session(index: int) -> list[dict]:
        body, previous, rows = dict(bodies[index]), homes[index], []
        for _ in range(rounds):
            started = time.perf_counter()
            try:
                answer = client.post("/infill", json={**body, "n_predict": n_predict, "session": f"client-{index}"})
                ok = answer.status_code == 200
            except httpx.HTTPError:
                answer, ok = None, False
            seconds = time.perf_counter() - started
            replica = answer.headers.get("x-codespec-replica") if answer is not None else None
            data = answer.json() if ok else {}
            rows.append({"ok": ok, "seconds": seconds, "replica": replica, "same_replica": replica == previous,
                         "tokens": data.get("tokens_predicted", 0), "cached": data.get("tokens_cached", 0)})
            previous = replica or previous
            if ok:
                body["prompt"] += data["content"].split("\n")[0]
        return rows

    started = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        rows = [row for result in pool.map(session, range(len(bodies))) for row in result]
    seconds = time.perf_counter() - started
    latencies = [row["seconds"] for row in rows if row["ok"]]
    spread: dict[str, int] = {}
    for home in homes.values():
        spread[str(home)] = spread.get(str(home), 0) + 1
    return {"sessions": len(bodies), "requests": len(rows), "failed": sum(not row["ok"] for row in rows),
            "affinity": round(sum(row["same_replica"] for row in rows) / len(rows), 4),
            "sessions_per_replica": sorted(spread.values(), reverse=True),
            "tokens": sum(row["tokens"] for row in rows), "seconds": round(seconds, 2),
            "tokens_per_second": round(sum(row["tokens"] for row in rows) / seconds, 2),
            "p50_s": round(statistics.median(latencies), 3) if latencies else None,
            "p95_s": round(percentile(latencies, 0.95), 3) if latencies else None,
            "mean_cached_tokens": round(statistics.mean(row["cached"] for row in rows), 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codespec.bench.replicas", description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", default="1,2", help="replica counts to compare, comma-separated")
    parser.add_argument("--cpus", type=float, default=2.0,
                        help="CPUs for the whole service: each replica gets cpus / N (default 2: this machine)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent editing sessions")
    parser.add_argument("--rounds", type=int, default=3, help="requests per session")
    parser.add_argument("--n-predict", type=int, default=32)
    parser.add_argument("--prefix-lines", type=int, default=64)
    parser.add_argument("--out", default="bench-results/replicas.json")
    parser.add_argument("serve_args", nargs="*", help="extra `codespec serve` arguments (after --)")
    args = parser.parse_args(argv)
    bodies = positions(args.clients, args.prefix_lines)
    report: dict = {"clients": args.clients, "rounds": args.rounds, "n_predict": args.n_predict,
                    "cpus": args.cpus, "serve_args": args.serve_args}
    for count in [int(n) for n in args.replicas.split(",")]:
        extra = ["--replicas", str(count), "--replica-cpus", f"{args.cpus / count:g}", *args.serve_args]
        with serve(None, extra) as client:
            client.post("/infill", json={**bodies[-1], "n_predict": 4})  # first-request costs out of the way
            report[f"replicas_{count}"] = run = sessions_run(client, bodies, args.n_predict, args.rounds)
            report[f"replicas_{count}_routes"] = metric_lines(client, "codespec_replica_routes_total")
        print(f"  {count} replica(s): {run}", file=sys.stderr)
    write_report(args.out, report)
    counts = [int(n) for n in args.replicas.split(",")]
    base = report[f"replicas_{counts[0]}"]["tokens_per_second"]
    print(f"{args.clients} clients x {args.rounds} requests of {args.n_predict} tokens, {args.cpus:g} CPUs in all",
          file=sys.stderr)
    print("replicas  tok/s  vs first  p50 s  p95 s  affinity  failed  sessions per replica", file=sys.stderr)
    for count in counts:
        run = report[f"replicas_{count}"]
        print(f"{count:8d} {run['tokens_per_second']:6.1f} {run['tokens_per_second'] / base:8.2f}x {run['p50_s']:6.2f}"
              f" {run['p95_s']:6.2f} {run['affinity']:8.1%} {run['failed']:7d}  {run['sessions_per_replica']}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
