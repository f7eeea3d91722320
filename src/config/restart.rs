//! Settings read only when the gateway starts: its listeners, worker threads and the grace
//! period Pingora was given, the store, and the CA file of the upstream's connector. A reload
//! keeps their running values — so that `/admin/config` shows what is in force — and names
//! those the file changed, to be said in the log.

use serde::Serialize;
use serde_yaml::Value;

use super::Config;

impl Config {
    /// Puts the running values of the settings read only at start back in place; the paths
    /// of those `self` (the file reloaded) would have changed.
    pub fn keep_start_settings(&mut self, running: &Config) -> Vec<String> {
        let (was, now) = (&running.raw, &mut self.raw);
        let server = changed_keys(&was.server, &now.server);
        let mut changed: Vec<String> = ["listen", "admin_listen", "threads", "grace_period"]
            .into_iter()
            .filter(|key| server.iter().any(|k| k == key))
            .map(|key| format!("server.{key}"))
            .collect();
        now.server.listen = was.server.listen.clone();
        now.server.admin_listen = was.server.admin_listen.clone();
        now.server.threads = was.server.threads;
        now.server.grace_period = was.server.grace_period;
        self.listen = running.listen.clone();
        self.admin_listen = running.admin_listen.clone();
        self.threads = running.threads;
        self.grace_period = running.grace_period;

        if was.upstream.ca_file != now.upstream.ca_file {
            changed.push("upstream.ca_file".into());
        }
        now.upstream.ca_file = was.upstream.ca_file.clone();
        self.upstream.ca_file = running.upstream.ca_file.clone();

        if running.store != self.store {
            let keys = changed_keys(&was.store, &now.store);
            match keys.is_empty() {
                true => changed.push("store".into()),
                false => changed.extend(keys.into_iter().map(|k| format!("store.{k}"))),
            }
        }
        now.store = was.store.clone();
        self.store = running.store.clone();

        changed.extend(self.keep_tracer(running));
        self.keep_tls_listener(running);
        changed
    }

    /// `server.tls`: the listener is the running one — its address, and whether there is one
    /// at all — while the certificate and key are the file's, re-read on reload. (Said by
    /// `App::tls_on_reload`, which sees the file before this.)
    fn keep_tls_listener(&mut self, running: &Config) {
        match (
            &running.tls,
            self.tls.as_mut(),
            self.raw.server.tls.as_mut(),
        ) {
            (Some(run), Some(new), Some(raw)) => {
                new.listen = run.listen.clone();
                raw.listen = run.listen.clone();
            }
            (None, None, _) => {}
            // Added or removed: the running listener (or none) stays, and so does its block.
            _ => {
                self.tls = running.tls.clone();
                self.raw.server.tls = running.raw.server.tls.clone();
            }
        }
    }

    /// `tracing:`: the collector and the service name are the running tracer's (built once),
    /// as is whether there is one at all; only `sample_ratio` is taken from the file.
    fn keep_tracer(&mut self, running: &Config) -> Vec<String> {
        if running.tracing.is_none() && self.tracing.is_none() {
            return Vec::new(); // no tracer, nor one asked for: nothing is in force
        }
        let (was, now) = (&running.raw.tracing, &mut self.raw.tracing);
        let mut changed = Vec::new();
        match (was, now.as_mut(), &running.tracing, self.tracing.as_mut()) {
            (Some(was), Some(now), Some(run), Some(new)) => {
                changed.extend(
                    changed_keys(was, &*now)
                        .into_iter()
                        .filter(|k| k != "sample_ratio")
                        .map(|k| format!("tracing.{k}")),
                );
                now.otlp_endpoint = was.otlp_endpoint.clone();
                now.service_name = was.service_name.clone();
                new.traces_url = run.traces_url.clone();
                new.service_name = run.service_name.clone();
            }
            _ => {
                // Added, removed, or switched on or off by the endpoint: the running block.
                changed.push("tracing".into());
                self.raw.tracing = was.clone();
                self.tracing = running.tracing.clone();
            }
        }
        changed
    }
}

/// The keys of a section whose values differ between two versions of it, in order.
fn changed_keys<T: Serialize>(was: &T, now: &T) -> Vec<String> {
    let (Ok(Value::Mapping(was)), Ok(Value::Mapping(now))) =
        (serde_yaml::to_value(was), serde_yaml::to_value(now))
    else {
        return Vec::new();
    };
    let mut keys: Vec<String> = Vec::new();
    for key in was.keys().chain(now.keys()) {
        let Some(name) = key.as_str() else { continue };
        if was.get(key) != now.get(key) && !keys.iter().any(|k| k == name) {
            keys.push(name.to_string());
        }
    }
    keys
}
