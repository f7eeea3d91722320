#!/usr/bin/env python3
"""Submit a request as a tollgate job, then poll it, sleeping Retry-After between polls."""
import sys, time, urllib.request, urllib.error

gw, key, path = sys.argv[1:4]  # e.g. http://127.0.0.1:8080 demo-key /reports/generate

def call(method, url, headers={}):
    req = urllib.request.Request(url, method=method, headers={"X-API-Key": key, **headers})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:  # 4xx/5xx: the job's (or the gateway's) answer
        return e.code, e.headers, e.read()

status, headers, body = call("POST", gw + path, {"Prefer": "respond-async"})
if status != 202:
    sys.exit(f"not accepted as a job: {status} {body.decode()}")
job = gw + headers["Location"]
while status == 202:  # queued or running: wait as long as the gateway suggests
    time.sleep(int(headers.get("Retry-After", "1")))
    status, headers, body = call("GET", job)
print(status, body.decode())
