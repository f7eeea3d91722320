//! The standard `process_*` metrics, with `process_cpu_seconds_total` in fractions of a
//! second.
//!
//! The `prometheus` crate's process collector (0.14) keeps CPU time in an integer counter:
//! `(utime + stime) / CLK_TCK` truncated to whole seconds, so a gateway that used 2.88 s
//! showed 2, and `rate()` over a few minutes of a lightly loaded instance read 0. This
//! collector takes the crate's families as they are and sets that one from the same ticks in
//! `/proc/self/stat`, divided as floats.

use prometheus::core::{Collector, Desc};
use prometheus::process_collector::ProcessCollector;
use prometheus::proto::{Counter, MetricFamily};

const CPU: &str = "process_cpu_seconds_total";

pub struct Process {
    inner: ProcessCollector,
}

impl Process {
    pub fn for_self() -> Process {
        Process {
            inner: ProcessCollector::for_self(),
        }
    }
}

/// Puts this collector in the default registry in place of the crate's own, which the
/// registry registers by itself (feature `process`): two collectors of the same names cannot
/// both be registered, and the crate's would win.
pub fn register() {
    // Unregistering matches by the metrics' descriptions, which every process collector of
    // this process shares.
    let _ = prometheus::unregister(Box::new(ProcessCollector::for_self()));
    if let Err(e) = prometheus::register(Box::new(Process::for_self())) {
        tracing::warn!(error = %e, "cannot register the process metrics");
    }
}

impl Collector for Process {
    fn desc(&self) -> Vec<&Desc> {
        self.inner.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let mut families = self.inner.collect();
        if let Some(seconds) = cpu_seconds() {
            for family in families.iter_mut().filter(|f| f.name() == CPU) {
                for m in family.mut_metric() {
                    let mut c = Counter::default();
                    c.set_value(seconds);
                    m.set_counter(c);
                }
            }
        }
        families
    }
}

/// User plus system CPU time of this process, in seconds.
pub fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let (utime, stime) = cpu_ticks(&stat)?;
    Some((utime + stime) as f64 / clock_ticks_per_second()?)
}

/// `utime` and `stime` (fields 14 and 15) of a `/proc/<pid>/stat` line. The command name
/// (field 2) is in parentheses and may itself hold spaces or parentheses: fields are counted
/// from the last `)`.
fn cpu_ticks(stat: &str) -> Option<(u64, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime = fields.next()?.parse().ok()?;
    let stime = fields.next()?.parse().ok()?;
    Some((utime, stime))
}

fn clock_ticks_per_second() -> Option<f64> {
    // SAFETY: sysconf reads a constant of the running system; no memory is passed.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (ticks > 0).then_some(ticks as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_from_a_stat_line_with_an_awkward_name() {
        let line = "4242 (tollgate (x) y) S 1 4242 4242 0 -1 4194560 1234 0 0 0 288 12 0 0 20 0 9 0 100 0 0";
        assert_eq!(cpu_ticks(line), Some((288, 12)));
        assert_eq!(cpu_ticks("garbage"), None);
    }

    /// What `/metrics` exports (the default registry, once the gateway's metrics exist) has
    /// the fraction the crate's own collector cuts off, and agrees with `/proc` at the time of
    /// the scrape.
    #[test]
    fn cpu_seconds_keep_their_fraction() {
        // Burn a little CPU so the figure is not 0.
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < std::time::Duration::from_millis(150) {
            x = x.wrapping_mul(31).wrapping_add(7);
        }
        std::hint::black_box(x);
        let _ = crate::telemetry::metrics();
        let before = cpu_seconds().unwrap();
        let families = prometheus::gather();
        let after = cpu_seconds().unwrap();
        let cpu = families.iter().find(|f| f.name() == CPU).unwrap();
        let v = cpu.get_metric()[0].get_counter().get_value();
        assert!(before <= v && v <= after, "{before} <= {v} <= {after}");
        assert!(v > 0.0);
        let tick = 1.0 / clock_ticks_per_second().unwrap();
        assert!(
            (v / tick - (v / tick).round()).abs() < 1e-6,
            "{v} is a whole number of ticks"
        );
    }
}
