//! What the upstream says a request cost (`cost_from_response`, DESIGN §6).
//!
//! The backend knows what a request consumed (rows scanned, a fan-out's width); when its
//! response head states that as a non-negative integer, the request's final charge becomes
//! it. A statement the gateway cannot trust — not an integer, negative, repeated with
//! different values, or above [`BOUND_FACTOR`] × the route's cost (a bug or a unit mix-up
//! upstream must not drain a budget a hundred times over) — is ignored, and counted.

use http::{HeaderMap, HeaderName};

/// A stated cost above this many times the route's `cost` is not believed.
pub const BOUND_FACTOR: u64 = 100;

/// What one response said about its cost: the `result` of `tollgate_cost_reports_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Report {
    /// A cost the charge settles on.
    Applied(u64),
    /// No such header: the charge stands.
    Missing,
    /// A header the gateway does not believe: the charge stands.
    Invalid,
}

/// Every `result` label, for the series a route announces at zero.
pub const RESULTS: [&str; 3] = [
    Report::Applied(0).label(),
    Report::Missing.label(),
    Report::Invalid.label(),
];

impl Report {
    /// Reads the header `name` of a response to a request of a route of `cost`.
    pub fn read(headers: &HeaderMap, name: &HeaderName, cost: u64) -> Report {
        let mut values = headers.get_all(name).iter();
        let Some(first) = values.next() else {
            return Report::Missing;
        };
        let parsed = parse(first.as_bytes());
        // Repeated: believed only when every copy says the same.
        if values.any(|v| parse(v.as_bytes()) != parsed) {
            return Report::Invalid;
        }
        match parsed {
            Some(n) if n <= cost.saturating_mul(BOUND_FACTOR) => Report::Applied(n),
            _ => Report::Invalid,
        }
    }

    /// The `result` label of `tollgate_cost_reports_total`.
    pub const fn label(self) -> &'static str {
        match self {
            Report::Applied(_) => "applied",
            Report::Missing => "missing",
            Report::Invalid => "invalid",
        }
    }
}

/// A non-negative decimal integer, optional whitespace around it; no sign, no fraction.
fn parse(v: &[u8]) -> Option<u64> {
    let v = v.trim_ascii();
    if v.is_empty() || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(v).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(values: &[&str], cost: u64) -> Report {
        let name = HeaderName::from_static("x-actual-cost");
        let mut h = HeaderMap::new();
        for v in values {
            h.append(&name, v.parse().unwrap());
        }
        Report::read(&h, &name, cost)
    }

    #[test]
    fn believes_only_a_plain_integer_within_the_bound() {
        assert_eq!(read(&[], 1), Report::Missing);
        assert_eq!(read(&["7"], 1), Report::Applied(7));
        assert_eq!(read(&["0"], 5), Report::Applied(0));
        assert_eq!(read(&[" 12 "], 1), Report::Applied(12));
        assert_eq!(read(&["100"], 1), Report::Applied(100), "at the bound");
        assert_eq!(read(&["101"], 1), Report::Invalid, "above 100 × cost");
        assert_eq!(read(&["500"], 5), Report::Applied(500));
        for bad in [
            "-3",
            "+3",
            "2.5",
            "abc",
            "",
            "1e3",
            "3 units",
            "99999999999999999999999",
        ] {
            assert_eq!(read(&[bad], 10), Report::Invalid, "{bad:?}");
        }
        assert_eq!(read(&["4", "4"], 1), Report::Applied(4), "repeated alike");
        assert_eq!(
            read(&["4", "5"], 1),
            Report::Invalid,
            "repeated, disagreeing"
        );
        assert_eq!(
            RESULTS,
            [Report::Applied(0), Report::Missing, Report::Invalid].map(Report::label)
        );
    }
}
