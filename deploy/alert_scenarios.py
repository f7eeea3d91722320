#!/usr/bin/env python3
"""Each alert against the situation it exists for, with a real gateway (deploy/check.sh, check 7).

A real `tollgate run` (real Redis where the scenario needs one, `tollgate demo-upstream`
upstream, free loopback ports) goes through each scenario below while its /metrics is scraped
every SCRAPE_EVERY seconds, as Prometheus would (`up` is 1 when the scrape answers, 0 when
it does not; a series that stops being exported gets a staleness marker). The recording
becomes a promtool unit test with one scrape per minute - time runs 120 times faster than
it did, which rate() ratios and `for:` durations do not mind - and each checkpoint asserts the
exact set of the scenario's alerts that fire (ALERTS{alertstate="firing"}). So a rule that
cannot fire in its situation (StoreErrors while Redis is down), fires outside it, or counts
what it should not (the latency SLO after the only instance stopped) fails the check.

It also checks a value that a panel plots against its source: process_cpu_seconds_total
against the gateway's own /proc/<pid>/stat.

    python3 deploy/alert_scenarios.py TOLLGATE_BIN RULES_FILE OUT.test.yml

writes OUT.test.yml (run it with `promtool test rules`); needs redis-server and PyYAML.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

try:
    import yaml
except ImportError:
    sys.exit("alert_scenarios.py: python3 cannot import yaml (Debian: apt-get install python3-yaml)")

# Real seconds between two scrapes; each becomes one minute in the promtool test.
SCRAPE_EVERY = 0.5
JOB = "tollgate"
INSTANCE = "tollgate-1:9901"
# What a scenario records: the gateway's own series and the standard process ones.
KEEP = re.compile(r"^(tollgate_|process_)")


def sha256(text):
    import hashlib
    return hashlib.sha256(text.encode()).hexdigest()


def free_ports(n):
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def http(url, headers=None, timeout=5):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def wait_port(port, within=30):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    sys.exit(f"alert_scenarios.py: nothing listens on 127.0.0.1:{port} after {within}s")


class Processes:
    """The processes a scenario started; all stopped (by handle) when it ends."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.procs = []

    def start(self, name, args):
        log = open(os.path.join(self.workdir, f"{name}.log"), "w")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((name, p))
        return p

    def stop_all(self):
        for _, p in self.procs:
            if p.poll() is None:
                p.kill()
        for _, p in self.procs:
            p.wait()

    def logs(self):
        out = []
        for name, _ in self.procs:
            with open(os.path.join(self.workdir, f"{name}.log")) as f:
                out.append(f"--- {name}.log ---\n{f.read()[-4000:]}")
        return "\n".join(out)


class Recording:
    """Scrapes of one gateway, as Prometheus would have stored them."""

    def __init__(self, admin):
        self.admin = admin
        self.samples = {}  # series -> {scrape index: value}
        self.n = 0
        self.target = True  # False once the target is gone from service discovery

    def scrape(self):
        i = self.n
        self.n += 1
        if not self.target:
            return
        status, text = http(f"{self.admin}/metrics", timeout=2)
        up = 1 if status == 200 else 0
        self.samples.setdefault(f'up{{instance="{INSTANCE}",job="{JOB}"}}', {})[i] = up
        if not up:
            return
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)$", line)
            if not m or not KEEP.match(m.group(1)):
                continue
            labels = m.group(2)[1:-1] if m.group(2) else ""
            labels = f'instance="{INSTANCE}",job="{JOB}"' + ("," + labels if labels else "")
            self.samples.setdefault(f"{m.group(1)}{{{labels}}}", {})[i] = m.group(3)

    def input_series(self):
        out = []
        for series, values in sorted(self.samples.items()):
            cells, seen = [], False
            for i in range(self.n):
                if i in values:
                    cells.append(str(values[i]))
                    seen = True
                elif seen and cells[-1] not in ("stale", "_"):
                    cells.append("stale")
                else:
                    cells.append("_")
            out.append({"series": series, "values": " ".join(cells)})
        return out


class Traffic:
    """Threads sending requests in a loop until stopped."""

    def __init__(self):
        self.stop = threading.Event()
        self.threads = []
        self.statuses = {}
        self.lock = threading.Lock()

    def loop(self, url, headers, pause=0.0):
        def run():
            while not self.stop.is_set():
                status, _ = http(url, headers, timeout=30)
                with self.lock:
                    self.statuses[status] = self.statuses.get(status, 0) + 1
                if pause:
                    self.stop.wait(pause)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def end(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=40)


class Scenario:
    """One gateway run; `checkpoints` are (scrape index, alerts that must fire then)."""

    def __init__(self, name, watched):
        self.name = name
        self.watched = watched
        self.checkpoints = []

    def record(self, rec, scrapes):
        """Scrapes `scrapes` times, one every SCRAPE_EVERY seconds."""
        next_at = time.monotonic()
        for _ in range(scrapes):
            rec.scrape()
            next_at += SCRAPE_EVERY
            time.sleep(max(0.0, next_at - time.monotonic()))

    def expect(self, rec, firing):
        """Checks the alerts at the last scrape so far."""
        self.checkpoints.append((rec.n - 1, sorted(firing)))

    def test(self, rec):
        watched = "|".join(sorted(self.watched))
        return {
            "name": self.name,
            "interval": "1m",
            "input_series": rec.input_series(),
            "promql_expr_test": [
                {
                    "expr": f'group by (alertname) (ALERTS{{alertstate="firing",alertname=~"{watched}"}})',
                    "eval_time": f"{i}m",
                    "exp_samples": [
                        {"labels": f'{{alertname="{a}"}}', "value": 1} for a in firing
                    ],
                }
                for i, firing in self.checkpoints
            ],
        }


def gateway_yaml(ports, upstream, store, body):
    proxy, admin = ports
    return f"""server:
  listen: "127.0.0.1:{proxy}"
  admin_listen: "127.0.0.1:{admin}"
  threads: 1
  grace_period: 1s
upstream:
  url: "http://127.0.0.1:{upstream}"
  connect_timeout: 1s
  read_timeout: 30s
{store}
{body}
"""


def start_gateway(procs, tollgate, workdir, name, yaml_text):
    path = os.path.join(workdir, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(yaml_text)
    p = procs.start(name, [tollgate, "run", "-c", path])
    return p, path


def ready(admin, within=30):
    deadline = time.monotonic() + within
    while http(f"{admin}/readyz")[0] != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"tollgate at {admin} never became ready")
        time.sleep(0.1)


def check_cpu(pid, admin):
    """process_cpu_seconds_total is the process's CPU time as /proc has it, fraction kept."""
    tick = os.sysconf("SC_CLK_TCK")

    def proc_seconds():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    before = proc_seconds()
    text = http(f"{admin}/metrics")[1]
    after = proc_seconds()
    m = re.search(r"^process_cpu_seconds_total (\S+)$", text, re.M)
    if not m:
        raise RuntimeError("process_cpu_seconds_total is not exported")
    value = float(m.group(1))
    if not before - 1e-9 <= value <= after + 1e-9:
        raise RuntimeError(
            f"process_cpu_seconds_total is {value}, /proc/{pid}/stat says {before}..{after} s"
        )
    print(f"  process_cpu_seconds_total {value} = /proc/{pid}/stat {before}..{after} s")


def redis_outage(tollgate, workdir, procs):
    """Redis dies under traffic: StoreErrors, StoreDegraded and FallbackDecisions fire (the
    breaker's refusals are store errors). None of them, nor StoreSlow, before."""
    s = Scenario("Redis outage under traffic (recorded from a real gateway)",
                 {"TollgateStoreErrors", "TollgateStoreDegraded", "TollgateFallbackDecisions",
                  "TollgateStoreSlow"})
    redis_port, upstream, proxy, admin = free_ports(4)
    redis = procs.start("redis", ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no"])
    procs.start("upstream", [tollgate, "demo-upstream", "--listen", f"127.0.0.1:{upstream}"])
    wait_port(redis_port)
    store = f"""store:
  backend: redis
  url: "redis://127.0.0.1:{redis_port}/0"
  timeout: 250ms
  on_error: local
  fleet_size: 1"""
    body = f"""rate_limits:
  default: {{cost: 1, window: 1h, max_cost: 1000000}}
  endpoints:
    /items: {{cost: 1}}
keys:
  - {{id: steady, sha256: "{sha256('steady-key')}"}}"""
    gw, _ = start_gateway(procs, tollgate, workdir, "outage-gateway",
                          gateway_yaml((proxy, admin), upstream, store, body))
    admin_url = f"http://127.0.0.1:{admin}"
    ready(admin_url)
    traffic = Traffic()
    traffic.loop(f"http://127.0.0.1:{proxy}/items", {"X-API-Key": "steady-key"}, pause=0.01)
    rec = Recording(admin_url)
    s.record(rec, 10)
    s.expect(rec, [])
    check_cpu(gw.pid, admin_url)
    redis.kill()
    redis.wait()
    s.record(rec, 24)
    # StoreSlow is left out here: whether the breaker's probes into a dead Redis are slow
    # depends on how it died (refused at once, or a black hole that times out at 250ms).
    s.watched.discard("TollgateStoreSlow")
    s.expect(rec, ["TollgateStoreErrors", "TollgateStoreDegraded", "TollgateFallbackDecisions"])
    traffic.end()
    return s, rec


def capped_route_then_stop(tollgate, workdir, procs):
    """A capped route held at its cap (InFlightAtCap), slow by design and so outside the latency
    SLO; then the only instance stops: InstanceDown and FleetDown fire, the SLO stays quiet
    while its windows still hold the stopped instance's requests; then its target goes away
    from service discovery: TargetMissing."""
    s = Scenario("A capped route at its cap, then the only instance stops (recorded from a real gateway)",
                 {"TollgateInFlightAtCap", "TollgateLatencySLOBurn", "TollgateInstanceDown",
                  "TollgateFleetDown", "TollgateTargetMissing"})
    upstream, proxy, admin = free_ports(3)
    procs.start("upstream", [tollgate, "demo-upstream", "--listen", f"127.0.0.1:{upstream}"])
    body = f"""rate_limits:
  default: {{cost: 1, window: 1h, max_cost: 1000000}}
  endpoints:
    /items: {{cost: 1}}
    /reports/generate: {{cost: 1, max_in_flight: 3, queue_timeout: 30s}}
keys:
  - {{id: steady, sha256: "{sha256('steady-key')}"}}"""
    gw, _ = start_gateway(procs, tollgate, workdir, "capped-gateway",
                          gateway_yaml((proxy, admin), upstream, "store: {backend: memory}", body))
    admin_url = f"http://127.0.0.1:{admin}"
    ready(admin_url)
    traffic = Traffic()
    key = {"X-API-Key": "steady-key"}
    traffic.loop(f"http://127.0.0.1:{proxy}/items", key, pause=0.05)
    for _ in range(5):  # 5 callers for 3 slots: always full, 2 waiting
        traffic.loop(f"http://127.0.0.1:{proxy}/reports/generate?delay_ms=1200", key)
    rec = Recording(admin_url)
    s.record(rec, 14)
    s.expect(rec, ["TollgateInFlightAtCap"])
    traffic.end()
    gw.send_signal(signal.SIGTERM)
    gw.wait(timeout=30)
    s.record(rec, 24)
    s.expect(rec, ["TollgateInstanceDown", "TollgateFleetDown"])
    rec.target = False
    s.record(rec, 8)
    s.expect(rec, ["TollgateTargetMissing"])
    return s, rec


def refusals_errors_reload(tollgate, workdir, procs):
    """A key hammering past its budget (High429Ratio), a route whose upstream is gone
    (UpstreamErrors), then a reload of an invalid gateway.yaml (ConfigReloadFailed)."""
    s = Scenario("429s, an unreachable upstream, a failed reload (recorded from a real gateway)",
                 {"TollgateHigh429Ratio", "TollgateUpstreamErrors", "TollgateConfigReloadFailed",
                  "TollgateStoreErrors", "TollgateLatencySLOBurn"})
    upstream, proxy, admin, dead = free_ports(4)
    procs.start("upstream", [tollgate, "demo-upstream", "--listen", f"127.0.0.1:{upstream}"])
    body = f"""upstreams:
  gone: {{url: "http://127.0.0.1:{dead}"}}
rate_limits:
  default: {{cost: 1, window: 1h, max_cost: 1000000}}
  endpoints:
    /items: {{cost: 1}}
    /broken: {{cost: 1, upstream: gone}}
plans:
  tiny: {{max_cost: 5, window: 24h}}
keys:
  - {{id: steady, sha256: "{sha256('steady-key')}"}}
  - {{id: storm, sha256: "{sha256('storm-key')}", plan: tiny}}"""
    gw, path = start_gateway(procs, tollgate, workdir, "refusals-gateway",
                             gateway_yaml((proxy, admin), upstream, "store: {backend: memory}", body))
    admin_url = f"http://127.0.0.1:{admin}"
    ready(admin_url)
    traffic = Traffic()
    # As fast as they go: the alerts want more than 0.2 req/s on the route, 12 requests per
    # recorded minute (half a second here).
    traffic.loop(f"http://127.0.0.1:{proxy}/items", {"X-API-Key": "storm-key"})
    traffic.loop(f"http://127.0.0.1:{proxy}/items", {"X-API-Key": "steady-key"}, pause=0.02)
    traffic.loop(f"http://127.0.0.1:{proxy}/broken", {"X-API-Key": "steady-key"})
    rec = Recording(admin_url)
    s.record(rec, 4)
    s.expect(rec, [])
    s.record(rec, 18)
    s.expect(rec, ["TollgateHigh429Ratio", "TollgateUpstreamErrors"])
    with open(path, "a") as f:
        f.write("\nnot_a_section: [\n")
    gw.send_signal(signal.SIGHUP)
    s.record(rec, 3)
    s.expect(rec, ["TollgateHigh429Ratio", "TollgateUpstreamErrors", "TollgateConfigReloadFailed"])
    traffic.end()
    return s, rec


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    tollgate, rules, out = sys.argv[1:]
    if not shutil.which("redis-server"):
        sys.exit("alert_scenarios.py: redis-server not found (Debian: apt-get install redis-server)")
    tests = []
    for scenario in (redis_outage, capped_route_then_stop, refusals_errors_reload):
        workdir = tempfile.mkdtemp(prefix="tollgate-scenario-")
        procs = Processes(workdir)
        print(f"scenario: {scenario.__name__}", flush=True)
        try:
            s, rec = scenario(tollgate, workdir, procs)
            tests.append(s.test(rec))
        except Exception as e:
            procs.stop_all()
            print(procs.logs(), file=sys.stderr)
            sys.exit(f"alert_scenarios.py: {scenario.__name__}: {e}")
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    with open(out, "w") as f:
        yaml.safe_dump({"rule_files": [os.path.abspath(rules)], "evaluation_interval": "1m",
                        "tests": tests}, f, width=1 << 20)
    print(f"wrote {out}: {len(tests)} recorded scenarios")


if __name__ == "__main__":
    main()
