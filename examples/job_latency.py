#!/usr/bin/env python3
"""Against `tollgate demo`: a job's submission-to-result time beside the synchronous request's
(`?delay_ms=100` reports, a new connection per request, results polled every 2 ms), and how
many submissions one sequential client gets through a second."""
import http.client, time

def req(method, path, key, headers={}):
    c = http.client.HTTPConnection("127.0.0.1", 8080)
    c.request(method, path, headers={"X-API-Key": key, "Connection": "close", **headers})
    r = c.getresponse(); r.read(); c.close(); return r.status, r
sync, job = [], []
for i in range(60):
    t = time.perf_counter(); req("POST", "/reports/generate?delay_ms=100", f"sync-{i}"); sync.append(time.perf_counter() - t)
    t = time.perf_counter(); s, r = req("POST", "/reports/generate?delay_ms=100", f"job-{i}", {"Prefer": "respond-async"})
    loc = r.getheader("Location")
    while req("GET", loc, f"job-{i}")[0] == 202:
        time.sleep(0.002)
    job.append(time.perf_counter() - t)
q = lambda xs, p: sorted(xs)[int(p * (len(xs) - 1))] * 1000
print(f"synchronous      p50 {q(sync,.5):.1f} ms  p99 {q(sync,.99):.1f} ms")
print(f"job (to result)  p50 {q(job,.5):.1f} ms  p99 {q(job,.99):.1f} ms   (polled every 2 ms, a connection per request)")
n = 1000; t = time.perf_counter()
for i in range(n):
    req("POST", "/reports/generate?delay_ms=1", f"rate-{i}", {"Prefer": "respond-async"})
dt = time.perf_counter() - t
print(f"{n} submissions, one client, a connection each: {dt:.2f} s = {n/dt:.0f}/s")
