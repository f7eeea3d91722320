//! `tollgate audit`'s text: every instance's `/admin/audit`, merged, against the costs.

use std::fmt::Write;

use crate::audit::fetch::FetchError;
use crate::audit::{InstanceAudit, MergeError, Report};
use crate::config::Config;

/// An instance that did not answer, and why.
type Failed = (String, FetchError);
/// An `--admin` whose instance an earlier one named: (its place in the list, that earlier one).
type Same = (usize, String);
/// The first `--admin` that has each set of prices (costs, time prices, modes, plans), by its
/// config's hash, when they have more than one.
type Mixed = Vec<(String, String)>;

/// `tollgate audit`: reads every instance's `/admin/audit`, merges them and compares the
/// fleet's measured upstream time with the costs of `cfg` (or the instances' own). Returns the
/// text and the exit code: 0, 2 when some instance did not answer (it is named), 1 when none
/// did or their reports cannot be merged.
pub fn audit(cfg: Option<&Config>, admins: &[String], json: bool) -> (String, u8) {
    let answers = match fetch_all(admins) {
        Ok(a) => a,
        Err(e) => return (format!("tollgate audit: {e}\n"), 1),
    };
    // Named as the store's URL is: a password in the user information, or a token in the
    // query, is not repeated to the terminal (or a CI log).
    let admins: Vec<String> = admins
        .iter()
        .map(|a| crate::config::redact_url(a))
        .collect();
    let admins = &admins[..];
    let mut reports: Vec<InstanceAudit> = vec![];
    let mut failed = vec![];
    // An instance named twice (another spelling of its address): counted once.
    let mut first_named: Vec<(String, &String)> = vec![];
    let mut same: Vec<Same> = vec![];
    let mut configs: Vec<(String, String, String)> = vec![];
    for (n, (admin, answer)) in admins.iter().zip(answers).enumerate() {
        match answer {
            Ok(r) => {
                let seen = first_named
                    .iter()
                    .find(|(id, _)| !r.instance.is_empty() && *id == r.instance);
                match seen {
                    Some((_, first)) => same.push((n, (*first).clone())),
                    None => {
                        first_named.push((r.instance.clone(), admin));
                        let prices = r.prices();
                        if !configs.iter().any(|(_, _, p)| *p == prices) {
                            configs.push((admin.clone(), r.config_hash.clone(), prices));
                        }
                        reports.push(r);
                    }
                }
            }
            Err(e) => failed.push((admin.clone(), e)),
        }
    }
    let merged = crate::audit::merge(&reports);
    let code = match (&merged, reports.is_empty(), failed.is_empty()) {
        (Err(_), _, _) | (_, true, _) => 1,
        (Ok(_), false, false) => 2,
        (Ok(_), false, true) => 0,
    };
    let report = merged
        .as_ref()
        .ok()
        .filter(|_| !reports.is_empty())
        .map(|m| crate::audit::report(m, cfg));
    let merged = merged.as_ref().err();
    // Instances mid-rollout (or one not reloaded): the costs are the first's, unless a file
    // is audited against (`-c`), and the output says so.
    let mixed: Mixed = if configs.len() > 1 && cfg.is_none() {
        configs.into_iter().map(|(a, h, _)| (a, h)).collect()
    } else {
        vec![]
    };
    let out = if json {
        as_json(admins, &failed, &same, &mixed, report.as_ref(), merged)
    } else {
        as_text(admins, &failed, &same, &mixed, report.as_ref(), merged)
    };
    (out, code)
}

/// Every instance's answer, in `admins`' order; `Err` only when no runtime can be built.
fn fetch_all(admins: &[String]) -> std::io::Result<Vec<Result<InstanceAudit, FetchError>>> {
    let token = std::env::var("TOLLGATE_ADMIN_TOKEN")
        .ok()
        .filter(|t| !t.is_empty());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Concurrently, so that one slow instance costs one timeout, not one per instance.
    Ok(rt.block_on(async {
        let tasks: Vec<_> = admins
            .iter()
            .map(|a| {
                let (a, token) = (a.clone(), token.clone());
                tokio::spawn(async move { crate::audit::fetch::fetch(&a, token.as_deref()).await })
            })
            .collect();
        let mut answers = vec![];
        for t in tasks {
            answers.push(t.await.map_err(FetchError::from).and_then(|r| r));
        }
        answers
    }))
}

/// `--format json`: one object with every instance's state, the figures and any merge error.
fn as_json(
    admins: &[String],
    failed: &[Failed],
    same: &[Same],
    mixed: &Mixed,
    report: Option<&Report>,
    merged: Option<&MergeError>,
) -> String {
    let instances: Vec<serde_json::Value> = admins
        .iter()
        .enumerate()
        .map(|(n, a)| match failed.iter().find(|(f, _)| f == a) {
            Some((_, e)) => {
                serde_json::json!({"admin": a, "ok": false, "error": e.to_string()})
            }
            None => match same.iter().find(|(s, _)| *s == n) {
                Some((_, first)) => serde_json::json!({"admin": a, "ok": true, "same_as": first}),
                None => serde_json::json!({"admin": a, "ok": true}),
            },
        })
        .collect();
    let mut v = serde_json::json!({ "instances": instances });
    if !mixed.is_empty() {
        v["configs_differ"] = (mixed.iter())
            .map(|(a, h)| serde_json::json!({"admin": a, "config_hash": h}))
            .collect();
    }
    if let Some(r) = report {
        v["baseline_seconds"] = serde_json::json!(r.baseline_seconds);
        v["routes"] = serde_json::to_value(&r.routes).unwrap_or_default();
    }
    if let Some(e) = merged {
        v["error"] = e.to_string().into();
    }
    format!("{v:#}\n")
}

/// The text: who answered, who did not, and the table.
fn as_text(
    admins: &[String],
    failed: &[Failed],
    same: &[Same],
    mixed: &Mixed,
    report: Option<&Report>,
    merged: Option<&MergeError>,
) -> String {
    let mut out = String::new();
    let (asked, answered) = (admins.len(), admins.len() - failed.len());
    let _ = writeln!(out, "instances: {answered} of {asked} answered");
    for (n, first) in same {
        let admin = &admins[*n];
        let _ = writeln!(
            out,
            "  {admin}: the same instance as {first} (counted once)"
        );
    }
    for (admin, e) in failed {
        let _ = writeln!(
            out,
            "  UNREACHABLE {admin}: {e} (its traffic is not in the figures below)"
        );
    }
    if let Some((first, _)) = mixed.first() {
        let each: Vec<String> = (mixed.iter()).map(|(a, h)| format!("{h} at {a}")).collect();
        let _ = writeln!(
            out,
            "  CONFIGS DIFFER: {}; the costs below are {first}'s (audit against one file with -c)",
            each.join(", ")
        );
    }
    if let Some(e) = merged {
        let _ = writeln!(out, "cannot merge: {e}");
    }
    if let Some(r) = report {
        out.push('\n');
        out.push_str(&crate::audit::render_table(r));
    }
    out
}
