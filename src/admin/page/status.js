// tollgate's status page: hand-written, no framework, nothing fetched from elsewhere
// (src/admin/page.rs serves it). Every value is put in with textContent, never as HTML.
"use strict";

const REFRESH_MS = 2000;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

function seconds(s) {
  if (s >= 86400 && s % 86400 === 0) return s / 86400 + " d";
  if (s >= 3600 && s % 3600 === 0) return s / 3600 + " h";
  if (s >= 60 && s % 60 === 0) return s / 60 + " min";
  return s + " s";
}

function uptime(s) {
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
  if (d) return d + "d " + h + "h";
  if (h) return h + "h " + m + "m";
  return m + "m " + (s % 60) + "s";
}

function badge(id, text, kind) {
  const b = document.getElementById(id);
  b.textContent = text;
  b.className = "badge " + kind;
}

function renderStatus(s) {
  const facts = document.getElementById("facts");
  facts.replaceChildren(
    "version ", el("b", { text: s.version }),
    " \u00b7 config ", el("b", { text: s.config_hash.slice(0, 12) }),
    " \u00b7 up ", el("b", { text: uptime(s.uptime_seconds) }),
    s.draining ? el("b", { class: "badge bad", text: "draining" }) : "",
  );
  const st = s.store;
  document.getElementById("store-backend").textContent = st.backend;
  badge("store-health", st.ready ? (st.degraded ? "degraded" : "ok") : "unavailable",
    st.ready ? (st.degraded ? "warn" : "ok") : "bad");
  if (st.breaker === null) badge("store-breaker", "n/a", "");
  else badge("store-breaker", st.breaker, st.breaker === "open" ? "bad" : "ok");
  badge("store-fallback", st.fallback === "off" ? "off" : "in force: " + st.fallback,
    st.fallback === "off" ? "ok" : "warn");
  document.getElementById("store-on-error").textContent = st.on_error || "n/a";
  document.getElementById("store-fleet").textContent = st.fleet_size;

  const refused = document.getElementById("refused-keys");
  refused.replaceChildren(...(s.top_refused_keys.length
    ? s.top_refused_keys.map(k => el("tr", { "data-key": k.key },
        el("td", { class: "key", text: k.key }), el("td", { class: "n refused", text: k.refused })))
    : [el("tr", {}, el("td", { class: "dim", colspan: 2, text: "none" }))]));

  const plans = [s.default, ...s.plans];
  document.querySelector("#plans tbody").replaceChildren(...plans.map(p => el("tr", { "data-plan": p.name },
    el("td", { class: "key", text: p.name }),
    el("td", { text: p.budgets.map(b => b.max_cost + " / " + seconds(b.window_seconds)
      + (p.budgets.length > 1 ? " (" + b.name + ")" : "")).join(", ") }),
    el("td", { class: "n", text: p.max_delay_seconds ? seconds(p.max_delay_seconds) : "\u2013" }),
    el("td", { class: "n", text: p.max_in_flight_per_key ?? "\u2013" }),
    el("td", { class: "n", text: p.weight }),
    el("td", { class: "n", text: p.keys }),
  )));
}

function keysCell(r) {
  if (r.cap === undefined) return el("td", { class: "dim", text: "\u2013" });
  if (!r.keys.length) return el("td", { class: "dim", text: "none" });
  const ul = el("ul", { class: "keys" });
  for (const k of r.keys) {
    const what = [];
    if (k.running) what.push("holding " + k.running);
    if (k.waiting) what.push("waiting " + k.waiting);
    ul.append(el("li", { "data-key": k.key, "data-running": k.running, "data-waiting": k.waiting },
      el("span", { class: "id", text: k.key }), el("span", { class: "what", text: what.join(", ") })));
  }
  return el("td", {}, ul);
}

// With many endpoints, the table keeps the capped routes and those with traffic.
const MANY_ROUTES = 50;

function renderRoutes(v) {
  let admitted = 0, refused = 0;
  for (const r of v.routes) {
    admitted += r.last_minute.admitted;
    refused += r.last_minute.refused;
  }
  const many = v.routes.length > MANY_ROUTES;
  const shown = many
    ? v.routes.filter(r => r.cap !== undefined || r.last_minute.admitted || r.last_minute.refused)
    : v.routes;
  const rows = shown.map(r => {
    const capped = r.cap !== undefined;
    const dash = () => el("td", { class: "n dim", text: "\u2013" });
    let slots = el("td", { class: "dim", text: "uncapped" });
    if (capped) {
      // Through the CSSOM: the page's Content-Security-Policy allows no inline style attributes.
      const fill = el("div");
      fill.style.width = Math.min(100, Math.round(100 * r.running / Math.max(1, r.cap))) + "%";
      slots = el("td", { class: "slots" }, el("div", { class: "meter" + (r.running >= r.cap ? " full" : "") }, fill));
    }
    return el("tr", { "data-route": r.route },
      el("td", { class: "route", text: r.route }),
      el("td", { class: "n cost", text: r.cost }),
      capped ? el("td", { class: "n cap", text: r.cap }) : dash(),
      capped ? el("td", { class: "n running", text: r.running }) : dash(),
      capped ? el("td", { class: "n queued", text: r.queued }) : dash(),
      slots,
      keysCell(r),
      el("td", { class: "n admitted", text: r.last_minute.admitted }),
      el("td", { class: "n refused", text: r.last_minute.refused }),
    );
  });
  if (shown.length < v.routes.length) {
    rows.push(el("tr", {}, el("td", { class: "dim", colspan: 9,
      text: (v.routes.length - shown.length) + " uncapped routes without traffic in the last minute are not shown" })));
  }
  document.querySelector("#routes tbody").replaceChildren(...rows);
  document.getElementById("total-admitted").textContent = admitted;
  document.getElementById("total-refused").textContent = refused;
  const jobs = document.getElementById("jobs");
  if (!v.jobs || !v.jobs.length) {
    jobs.replaceChildren(el("p", { class: "empty", text: "No async jobs." }));
  } else {
    const head = el("tr", {}, el("th", { text: "Route" }), el("th", { class: "n", text: "Queued" }),
      el("th", { class: "n", text: "Running" }));
    const body = v.jobs.map(j => el("tr", {}, el("td", { class: "route", text: j.route }),
      el("td", { class: "n", text: String(j.queued) }), el("td", { class: "n", text: String(j.running) })));
    jobs.replaceChildren(el("table", {}, el("thead", {}, head), el("tbody", {}, ...body)));
  }
}

async function fetchJson(path) {
  const r = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (r.status === 401) {
    location.replace("/admin/");
    throw new Error("the admin session ended: sign in again");
  }
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(path + ": " + r.status + (body.error ? " " + body.error : ""));
  return body;
}

async function refresh() {
  const updated = document.getElementById("updated");
  const problem = document.getElementById("problem");
  // Each part is shown when it answers: while Redis is away /admin/routes cannot give the
  // fleet's slots (503), and that is when the store's health below matters most.
  try {
    const [routes, status] = await Promise.allSettled([fetchJson("/admin/routes"), fetchJson("/admin/status")]);
    const failed = [];
    for (const [part, render, section] of [[status, renderStatus, "store-card"], [routes, renderRoutes, "routes"]]) {
      // A part that could not be refreshed keeps its last figures, greyed out as stale.
      document.getElementById(section).classList.toggle("stale", part.status === "rejected");
      if (part.status === "rejected") {
        failed.push(String(part.reason && part.reason.message || part.reason));
        continue;
      }
      render(part.value);
    }
    const now = new Date().toLocaleTimeString([], { hour12: false });
    problem.textContent = failed.join("; ");
    problem.hidden = failed.length === 0;
    updated.dataset.state = failed.length === 0 ? "ok" : failed.length === 2 ? "error" : "partial";
    updated.textContent = failed.length === 0 ? "updated " + now
      : failed.length === 2 ? "refresh failed" : "partly updated " + now;
  } catch (e) {
    problem.textContent = String(e.message || e);
    problem.hidden = false;
    updated.dataset.state = "error";
    updated.textContent = "refresh failed";
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

// Trades the token for this browser's session cookie (/admin/session), then opens the page.
async function signIn(token) {
  const r = await fetch("/admin/session", {
    headers: { Authorization: "Bearer " + token }, credentials: "same-origin", cache: "no-store",
  });
  if (r.status !== 204) throw new Error("the token was not accepted (" + r.status + ")");
  location.replace("/admin/");
}

function signInPage() {
  const error = document.getElementById("signin-error");
  const fail = e => { error.textContent = String(e.message || e); error.hidden = false; };
  const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  // The fragment never reaches a server; drop it from the address bar and history all the same.
  if (location.hash) history.replaceState(null, "", location.pathname);
  if (m) signIn(decodeURIComponent(m[1])).catch(fail);
  document.getElementById("signin").addEventListener("submit", ev => {
    ev.preventDefault();
    signIn(document.getElementById("token").value).catch(fail);
  });
}

if (document.body.dataset.page === "signin") {
  signInPage();
} else {
  if (location.hash) history.replaceState(null, "", location.pathname);
  refresh();
}
