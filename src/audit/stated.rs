//! The audit's view of `cost_from_response` routes: what their upstream said requests cost,
//! on average, beside what the route is configured to cost. A backend that states 5 for a
//! route priced 1 is telling the operator the price is wrong, even though every request was
//! charged right.

use serde::{Deserialize, Serialize};

use super::{price_flag, MIN_SAMPLES};

/// One instance's (or a merged fleet's) stated costs of a route: the costs the upstream
/// stated and the gateway applied, counted and summed (exact to add across instances).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stated {
    /// The header the route reads (`cost_from_response`).
    pub header: String,
    pub reports: u64,
    pub sum: u64,
}

impl Stated {
    pub fn merge(&mut self, other: &Stated) {
        self.reports += other.reports;
        self.sum += other.sum;
    }

    pub fn mean(&self) -> Option<f64> {
        (self.reports > 0).then(|| self.sum as f64 / self.reports as f64)
    }
}

/// A route's mean stated cost against its configured `cost`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StatedFinding {
    pub header: String,
    pub reports: u64,
    pub mean_cost: Option<f64>,
    /// `under-priced` (the mean stated cost is more than 2× the configured one) or
    /// `over-priced` (less than half of it); never with fewer than [`MIN_SAMPLES`] reports.
    pub flag: Option<&'static str>,
}

impl StatedFinding {
    pub fn of(s: &Stated, cost: u64) -> StatedFinding {
        let mean = s.mean();
        let flag = mean
            .filter(|_| s.reports >= MIN_SAMPLES)
            .and_then(|m| price_flag(cost as f64, m));
        StatedFinding {
            header: s.header.clone(),
            reports: s.reports,
            mean_cost: mean,
            flag,
        }
    }

    /// The table's STATED cell.
    pub fn cell(&self) -> String {
        match self.mean_cost {
            Some(m) => format!("{m:.1} (n={})", self.reports),
            None => "none yet".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stated(reports: u64, sum: u64) -> Stated {
        Stated {
            header: "x-actual-cost".into(),
            reports,
            sum,
        }
    }

    #[test]
    fn flags_a_cost_more_than_twice_off_the_mean_stated_one() {
        let f = |reports, sum, cost| StatedFinding::of(&stated(reports, sum), cost).flag;
        assert_eq!(f(20, 100, 1), Some("under-priced"));
        assert_eq!(f(20, 60, 10), Some("over-priced"));
        assert_eq!(f(20, 40, 1), None, "exactly 2x is not flagged");
        assert_eq!(f(20, 0, 1), Some("over-priced"));
        assert_eq!(f(19, 1900, 1), None, "too few reports");
        let mut a = stated(3, 9);
        a.merge(&stated(1, 3));
        assert_eq!(a.mean(), Some(3.0));
        assert_eq!(StatedFinding::of(&stated(0, 0), 1).cell(), "none yet");
    }
}
