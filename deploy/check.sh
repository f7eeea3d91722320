#!/usr/bin/env bash
# Checks the deployment artefacts under deploy/ with the real tools.
#
#   deploy/check.sh                  run every check below; non-zero exit on any failure
#   deploy/check.sh --metrics        only check 5 (dashboard and rules against a running
#                                    tollgate's /metrics); needs TOLLGATE_BIN and python3 + PyYAML
#   deploy/check.sh --list-metrics   print the metric names that the dashboard and the alert
#                                    rules use, sorted and unique, one per line (nothing else on
#                                    stdout); needs only python3 with PyYAML
#
# The metric list is what the gateway must export: histogram suffixes (_bucket, _sum, _count)
# are stripped, names produced by our own recording rules are left out (their inputs are
# listed), and so are series that Prometheus makes itself (`up` and friends), which the
# gateway never exports.
#
# Checks:
#   1. promtool check rules / test rules / check config, and promtool parses every dashboard
#      query (written out as recording rules)
#   2. every YAML file under deploy/ parses (all documents), and so does the dashboard JSON;
#      gateway.yaml embedded in the Kubernetes ConfigMap included
#   3. the dashboard uses the provisioned datasource uid and has unique panel ids
#   4. every alert has a unit test where it fires and one where it does not, and its
#      runbook_url is a link into docs/operations.md whose anchor exists; the panels of a row
#      titled "... admitted ..." plot admitted requests only
#   5. the metrics match what the binary exports, both ways: a real `tollgate run` (memory
#      store, in front of `tollgate demo-upstream`, free loopback ports) gets a few requests
#      (200, 401, 429, a shadow-mode 200), its /metrics is scraped, and then every metric a panel or rule uses must
#      be exported (or be on the PENDING allow-list below), and every tollgate_* metric exported
#      must be used by some panel or rule. The binary is $TOLLGATE_BIN, else `tollgate` on PATH.
#   6. `tollgate check` on every shipped gateway config, and if installed: `kubectl kustomize
#      deploy/k8s` and `nginx -t` on deploy/nginx/nginx.conf
#   7. each alert in the situation it exists for: deploy/alert_scenarios.py runs a real
#      gateway through a Redis outage, a capped route at its cap, the only instance stopping
#      and its target vanishing, a 429 storm, an unreachable upstream and a failed reload,
#      records its /metrics as Prometheus would, and promtool checks which alerts fire at each
#      point (and that process_cpu_seconds_total agrees with /proc); needs redis-server
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# (The Python below names the same files.)
RULES=deploy/prometheus/rules/tollgate.rules.yml
RULE_TESTS=deploy/prometheus/tests/tollgate.rules.test.yml
PROM_CONFIG=deploy/prometheus/prometheus.yml

# The Python half: YAML/JSON parsing and PromQL metric extraction.
#   deploy_py list     -> metric names on stdout
#   deploy_py check    -> structural checks (2-4 above); problems on stderr, exit 1
#   deploy_py dashboard-rules FILE -> the dashboard's queries as a rules file for promtool
#   deploy_py gateway-configs DIR -> writes every shipped gateway.yaml into DIR, prints paths
#   deploy_py free-ports N -> N free loopback ports
#   deploy_py scrape PROXY_URL ADMIN_URL KEY FILE -> probe traffic, then /metrics into FILE
#   deploy_py compare FILE -> check 5 against the scraped FILE; problems on stderr, exit 1
deploy_py() {
    python3 - "$@" <<'PY'
import fnmatch
import json
import pathlib
import re
import socket
import sys
import time
import urllib.error
import urllib.request

try:
    import yaml
except ImportError:
    sys.exit("check.sh: python3 cannot import yaml (Debian: apt-get install python3-yaml)")

RULES = "deploy/prometheus/rules/tollgate.rules.yml"
RULE_TESTS = "deploy/prometheus/tests/tollgate.rules.test.yml"
DASHBOARD = "deploy/grafana/tollgate-dashboard.json"
RUNBOOK = "docs/operations.md"
# Where runbook_url links point (absolute: Alertmanager and Grafana show it as a link). Every
# alert uses this same base, so that one sed moves them all (see the rules file's header).
RUNBOOK_BASE = "https://github.com/example/tollgate/blob/main/"
CONFIGMAP = "deploy/k8s/configmap.yaml"
# A dashboard row whose title says "admitted" plots requests the gateway let through only:
# these metrics (tollgate_request_duration_seconds counts its refusals too).
ADMITTED_ONLY = {
    "tollgate_admitted_duration_seconds", "tollgate_upstream_duration_seconds",
    "tollgate_overhead_seconds",
    "tollgate_in_flight_limit",  # not a count: the capped routes, which the SLO leaves out
}

# The allow-list: DESIGN.md §5 metrics that are being added to the binary this round, so a
# panel or rule may use them before `tollgate run` exports them. Each entry goes as soon as its
# metric is exported: check 5 then prints "exported now: drop it from PENDING". Nothing else
# belongs here - a used metric that the binary does not export is a panel that never shows data.
PENDING = [
    "tollgate_jobs_total",  # async jobs (DESIGN §8): the "Queues and async jobs" row's jobs panel
]
# Series Prometheus creates itself; allowed in queries, never exported by the gateway.
PROMETHEUS_SERIES = {
    "up", "scrape_duration_seconds", "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling", "scrape_series_added", "ALERTS", "ALERTS_FOR_STATE",
}
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "atan2", "inf", "nan", "start", "end",
}

problems = []


def problem(msg):
    problems.append(msg)


def load_yaml_all(path):
    try:
        with open(path) as f:
            return list(yaml.safe_load_all(f))
    except (OSError, yaml.YAMLError) as e:
        sys.exit(f"check.sh: {path}: invalid YAML: {e}")


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"check.sh: {path}: invalid JSON: {e}")


def metric_names(expr):
    """Metric names in a PromQL expression (Grafana variables allowed)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)                    # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)                   # ranges, subqueries ($__rate_interval)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)                  # Grafana variables elsewhere
    names = set()
    # An identifier not glued to a number (1e3, 15m) and not followed by "(" (a function).
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()", s):
        if m.group(1) not in PROMQL_WORDS:
            names.add(m.group(1))
    return names


def template_query_names(query):
    """Metric names in a Grafana Prometheus variable query."""
    if isinstance(query, dict):
        query = query.get("query", "")
    m = re.fullmatch(r"\s*label_values\((.*),\s*[a-zA-Z_]\w*\s*\)\s*", query or "")
    if m:
        return metric_names(m.group(1))
    if re.fullmatch(r"\s*(label_values\(\s*\w+\s*\)|label_names\(\s*\))\s*", query or ""):
        return set()
    m = re.fullmatch(r"\s*query_result\((.*)\)\s*", query or "")
    return metric_names(m.group(1) if m else query or "")


def all_panels(panels):
    for p in panels:
        yield p
        yield from all_panels(p.get("panels", []))


def panels_by_row(panels):
    """(title of the row a panel is under, panel) for every non-row panel: a row holds the
    panels after it up to the next row, or its own `panels` when collapsed."""
    row = None
    for p in panels:
        if p.get("type") == "row":
            row = p.get("title")
            for q in p.get("panels", []):
                yield row, q
        else:
            yield row, p


def rules():
    docs = load_yaml_all(RULES)
    for group in (docs[0] or {}).get("groups", []):
        yield from group.get("rules", [])


def dashboard_exprs(dash):
    for p in all_panels(dash.get("panels", [])):
        for t in p.get("targets", []):
            if t.get("expr"):
                yield f"panel {p.get('title')!r}", metric_names(t["expr"])
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            yield f"variable {v.get('name')!r}", template_query_names(v.get("query"))


def used_metrics():
    recorded = {r["record"] for r in rules() if "record" in r}
    used = {}
    for r in rules():
        where = f"{RULES}: {r.get('alert') or r.get('record')}"
        for n in metric_names(str(r.get("expr", ""))):
            used.setdefault(n, where)
    for where, names in dashboard_exprs(load_json(DASHBOARD)):
        for n in names:
            used.setdefault(n, f"{DASHBOARD}: {where}")
    out = {}
    for n, where in used.items():
        if n in recorded or n in PROMETHEUS_SERIES:
            continue
        out.setdefault(re.sub(r"_(bucket|sum|count)$", "", n), where)
    return out


def github_anchor(heading):
    a = heading.strip().lower()
    a = re.sub(r"[^\w\- ]", "", a)
    return a.replace(" ", "-")


def check():
    # 2. Everything parses.
    for path in sorted(pathlib.Path("deploy").rglob("*")):
        if path.suffix in (".yml", ".yaml"):
            docs = load_yaml_all(path)
            if str(path) == CONFIGMAP:
                for doc in docs:
                    for key, text in ((doc or {}).get("data") or {}).items():
                        if key.endswith((".yaml", ".yml")):
                            try:
                                yaml.safe_load(text)
                            except yaml.YAMLError as e:
                                sys.exit(f"check.sh: {path}: data.{key}: invalid YAML: {e}")
        elif path.suffix == ".json":
            load_json(path)

    # 3. Dashboard: provisioned datasource, unique ids.
    dash = load_json(DASHBOARD)
    text = pathlib.Path(DASHBOARD).read_text()
    if "${DS_" in text or "__inputs" in text:
        problem(f"{DASHBOARD}: uses an import-time ${{DS_...}} input; use datasource uid 'prometheus'")
    ids = [p.get("id") for p in all_panels(dash.get("panels", []))]
    if len(ids) != len(set(ids)):
        problem(f"{DASHBOARD}: duplicate panel ids")
    for p in all_panels(dash.get("panels", [])):
        for ds in [p.get("datasource")] + [t.get("datasource") for t in p.get("targets", [])]:
            if ds and ds.get("uid") != "prometheus":
                problem(f"{DASHBOARD}: panel {p.get('title')!r}: datasource uid {ds.get('uid')!r}, expected 'prometheus'")
    # A panel plots what its row says: under "... (admitted requests)", admitted requests only.
    for row, p in panels_by_row(dash.get("panels", [])):
        if "admitted" not in (row or "").lower():
            continue
        for t in p.get("targets", []):
            for n in metric_names(t.get("expr", "")):
                base = re.sub(r"_(bucket|sum|count)$", "", n)
                if base.startswith("tollgate_") and base not in ADMITTED_ONLY:
                    problem(f"{DASHBOARD}: panel {p.get('title')!r} in row {row!r} plots {n}, which counts more than admitted requests")

    # 4. Alerts: tested both ways, runbook anchor exists.
    alerts = {}
    for r in rules():
        if "alert" in r:
            alerts.setdefault(r["alert"], []).append(r)
    fires, quiet = set(), set()
    for test in (load_yaml_all(RULE_TESTS)[0] or {}).get("tests", []):
        for case in test.get("alert_rule_test", []) or []:
            (fires if case.get("exp_alerts") else quiet).add(case.get("alertname"))
    try:
        runbook = pathlib.Path(RUNBOOK).read_text()
    except OSError as e:
        sys.exit(f"check.sh: {RUNBOOK}: {e}")
    anchors = {github_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", runbook, re.M)}
    for name, rs in sorted(alerts.items()):
        if name not in fires:
            problem(f"{RULE_TESTS}: no test case where {name} fires")
        if name not in quiet:
            problem(f"{RULE_TESTS}: no test case where {name} does not fire")
        for r in rs:
            url = (r.get("annotations") or {}).get("runbook_url", "")
            if not url.startswith(f"{RUNBOOK_BASE}{RUNBOOK}#"):
                problem(f"{RULES}: {name}: runbook_url {url!r} is not a link into {RUNBOOK_BASE}{RUNBOOK}")
            elif url.split("#", 1)[1] not in anchors:
                problem(f"{RULES}: {name}: {RUNBOOK} has no heading for #{url.split('#', 1)[1]}")
            for key in ("summary", "description"):
                if not (r.get("annotations") or {}).get(key):
                    problem(f"{RULES}: {name}: missing annotation {key}")

    report_problems()


def report_problems():
    if problems:
        for p in problems:
            print(f"check.sh: {p}", file=sys.stderr)
        sys.exit(1)


def free_ports(n):
    """n free loopback ports (held open together so that they differ)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    print(" ".join(str(s.getsockname()[1]) for s in socks))
    for s in socks:
        s.close()


def http_get(url, headers=None):
    """(status, body); status 0 when nothing answers."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def scrape(proxy, admin, key, out):
    """Waits for the gateway, sends requests that create the per-event series (a 401, two 200s
    and a 429 of a registry key: max_cost is 2; then a request to a `mode: shadow` route that
    the spent budget would refuse, forwarded: 200), and writes /metrics to `out`."""
    deadline = time.monotonic() + 60
    while http_get(f"{admin}/readyz")[0] != 200:
        if time.monotonic() > deadline:
            sys.exit(f"check.sh: tollgate at {admin} never became ready (its log follows)")
        time.sleep(0.2)
    statuses = [http_get(f"{proxy}/items")[0]]
    statuses += [http_get(f"{proxy}/items", {"X-API-Key": key})[0] for _ in range(3)]
    statuses += [http_get(f"{proxy}/shadowed", {"X-API-Key": key})[0]]
    if statuses != [401, 200, 200, 429, 200]:
        sys.exit(f"check.sh: probe requests answered {statuses}, expected [401, 200, 200, 429, 200]")
    # Series are recorded just after each response is sent: wait for the last one's. If it
    # never shows, the comparison below reports it.
    deadline = time.monotonic() + 10
    text = http_get(f"{admin}/metrics")[1]
    while ("tollgate_rejections_by_key_total{" not in text
           or "tollgate_shadow_rejections_total{" not in text) and time.monotonic() < deadline:
        time.sleep(0.1)
        text = http_get(f"{admin}/metrics")[1]
    pathlib.Path(out).write_text(text)


def exported_names(text):
    """Metric family names in a Prometheus text exposition (histograms by base name)."""
    names = {m.group(1) for m in re.finditer(r"^# TYPE (\S+) \S+", text, re.M)}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.sub(r"_(bucket|sum|count)$", "", re.split(r"[{ ]", line, 1)[0]))
    return names


def compare(metrics_file):
    """Check 5: both ways between what panels and rules use and what the binary exports."""
    exported = exported_names(pathlib.Path(metrics_file).read_text())
    used = used_metrics()

    def pending(name):
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in PENDING)

    waiting = []
    for name, where in sorted(used.items()):
        if name in exported:
            if pending(name):
                print(f"note: {name} is exported now: drop it from PENDING in deploy/check.sh")
        elif pending(name):
            waiting.append(name)
        else:
            problem(f"{where}: uses {name}, which tollgate does not export")
    for name in sorted(exported):
        if name.startswith("tollgate_") and name not in used:
            problem(f"tollgate exports {name}, but no dashboard panel or alert rule uses it")
    for pattern in PENDING:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in used):
            problem(f"PENDING lists {pattern}, which no panel or rule uses: drop it")
    print(f"{len(used)} metrics used, {len(used.keys() & exported)} of them exported by the binary")
    if waiting:
        print(f"not exported yet, allowed by PENDING: {' '.join(waiting)}")
    report_problems()


def dashboard_rules(out):
    """The dashboard's queries as a rules file, so that promtool parses them. Grafana's
    interval variables become 5m, the others match-anything regexes."""
    rules_out = []
    for p in all_panels(load_json(DASHBOARD).get("panels", [])):
        for t in p.get("targets", []):
            if t.get("expr"):
                expr = re.sub(r"\$__\w+", "5m", t["expr"])
                expr = re.sub(r"\$\{?\w+\}?", ".*", expr)
                rules_out.append({"record": f"dashboard:panel_{p['id']}_{t['refId']}", "expr": expr})
    with open(out, "w") as f:
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules_out}]}, f)


def gateway_configs(outdir):
    """Every gateway.yaml we ship, as files (the ConfigMap's is embedded)."""
    for path in sorted(pathlib.Path("deploy").glob("gateway.*.yaml")):
        print(path)
    for doc in load_yaml_all(CONFIGMAP):
        text = ((doc or {}).get("data") or {}).get("gateway.yaml")
        if text:
            out = pathlib.Path(outdir) / "k8s-configmap-gateway.yaml"
            out.write_text(text)
            print(out)


mode = sys.argv[1]
if mode == "list":
    print("\n".join(sorted(used_metrics())))
elif mode == "check":
    check()
elif mode == "dashboard-rules":
    dashboard_rules(sys.argv[2])
elif mode == "gateway-configs":
    gateway_configs(sys.argv[2])
elif mode == "free-ports":
    free_ports(int(sys.argv[2]))
elif mode == "scrape":
    scrape(*sys.argv[2:6])
elif mode == "compare":
    compare(sys.argv[2])
PY
}

step() { printf '\n==> %s\n' "$*"; }

tmp="$(mktemp -d)"
pids=()
cleanup() {
    # Only the processes this script started, by pid.
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$tmp"
}
trap cleanup EXIT

tollgate_bin="${TOLLGATE_BIN:-$(command -v tollgate || true)}"

# Check 5: start the real binary (memory store, free loopback ports, the built-in sample API as
# upstream), scrape it and compare its metrics with the dashboard's and the rules'.
check_exported_metrics() {
    if [[ -z "$tollgate_bin" || ! -x "$tollgate_bin" ]]; then
        echo "check.sh: no tollgate binary to scrape: set TOLLGATE_BIN=path/to/tollgate" >&2
        exit 1
    fi
    local upstream_port proxy_port admin_port key_sha
    read -r upstream_port proxy_port admin_port <<<"$(deploy_py free-ports 3)"
    # A registry key with a budget of 2: its third request is a 429, which is what creates
    # the per-key rejection series. The key is a throwaway; only its hash is in the file.
    key_sha="$(printf '%s' check-sh-probe-key | sha256sum | cut -d' ' -f1)"
    cat >"$tmp/probe.yaml" <<YAML
server:
  listen: "127.0.0.1:$proxy_port"
  admin_listen: "127.0.0.1:$admin_port"
  threads: 1
  grace_period: 1s
upstream:
  url: "http://127.0.0.1:$upstream_port"
store:
  backend: memory
rate_limits:
  default: { cost: 1, window: 1h, max_cost: 2 }
  endpoints:
    /reports/generate: { cost: 1, max_in_flight: 1 }   # a capped route: tollgate_in_flight_limit
    /shadowed: { cost: 1, mode: shadow }               # tollgate_shadow_rejections_total
keys:
  - { id: probe, sha256: "$key_sha" }
YAML
    "$tollgate_bin" demo-upstream --listen "127.0.0.1:$upstream_port" >"$tmp/upstream.log" 2>&1 &
    pids+=($!)
    "$tollgate_bin" run -c "$tmp/probe.yaml" >"$tmp/tollgate.log" 2>&1 &
    pids+=($!)
    echo "$tollgate_bin run: proxy 127.0.0.1:$proxy_port, admin 127.0.0.1:$admin_port"
    if ! deploy_py scrape "http://127.0.0.1:$proxy_port" "http://127.0.0.1:$admin_port" \
            check-sh-probe-key "$tmp/metrics.txt"; then
        cat "$tmp/tollgate.log" "$tmp/upstream.log" >&2
        exit 1
    fi
    deploy_py compare "$tmp/metrics.txt"
}

case "${1:-}" in
    --list-metrics)
        deploy_py list
        exit 0
        ;;
    --metrics)
        command -v python3 >/dev/null || { echo "check.sh: python3 not found" >&2; exit 1; }
        step "dashboard and alert rules against the metrics of a running tollgate"
        check_exported_metrics
        exit 0
        ;;
    "") ;;
    *)
        echo "usage: deploy/check.sh [--metrics | --list-metrics]" >&2
        exit 2
        ;;
esac

command -v promtool >/dev/null || { echo "check.sh: promtool not found (Debian: apt-get install prometheus)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "check.sh: python3 not found" >&2; exit 1; }

step "promtool check rules"
promtool check rules "$RULES"

step "promtool test rules"
promtool test rules "$RULE_TESTS"

step "promtool check config (rule_files resolve relative to the config file)"
promtool check config "$PROM_CONFIG"

step "promtool parses the dashboard's PromQL"
deploy_py dashboard-rules "$tmp/dashboard.rules.yml"
promtool check rules "$tmp/dashboard.rules.yml"

step "YAML/JSON parse, dashboard, alert tests and runbook anchors"
deploy_py check
echo "ok"

step "dashboard and alert rules against the metrics of a running tollgate"
check_exported_metrics

step "kubectl kustomize deploy/k8s"
if command -v kubectl >/dev/null; then
    kubectl kustomize deploy/k8s >"$tmp/k8s.yaml"
    echo "ok ($(grep -c '^kind:' "$tmp/k8s.yaml") objects)"
else
    echo "skipped: kubectl not installed"
fi

step "nginx -t deploy/nginx/nginx.conf"
if command -v nginx >/dev/null; then
    # The compose service names do not resolve here; nginx -t would fail on them.
    sed -E 's/tollgate-[0-9]+:8080/127.0.0.1:8080/' deploy/nginx/nginx.conf >"$tmp/nginx.conf"
    nginx -t -q -p "$tmp" -c "$tmp/nginx.conf" -g "pid $tmp/nginx.pid;"
    echo "ok"
else
    echo "skipped: nginx not installed"
fi

step "tollgate check on the shipped gateway configs"
deploy_py gateway-configs "$tmp" | while read -r config; do
    echo "$config"
    "$tollgate_bin" check -c "$config"
done

step "each alert in the situation it exists for (recorded from a real gateway)"
python3 deploy/alert_scenarios.py "$tollgate_bin" "$RULES" "$tmp/scenarios.test.yml"
promtool test rules "$tmp/scenarios.test.yml"

step "metrics used by the dashboard and the alert rules"
deploy_py list

printf '\nall checks passed\n'
