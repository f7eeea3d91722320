//! The closed sets a decision is told by: why a request was refused (`reason` of
//! `tollgate_rejections_total` and `tollgate_shadow_rejections_total`) and what became of it
//! (the access log's and the span's `decision`). Both are contract (DESIGN §5): a value typed
//! out by hand elsewhere would compile, and a typo would be a new metric series. Each value is
//! spelled once, in its `as_str`.

use std::fmt;

/// Why the gateway refused a request: the `reason` label of the rejection counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// A budget of the key's plan would go below zero.
    Budget,
    /// The route's `shared` budget (all callers') refused, or its line was full.
    SharedBudget,
    /// The key's plan's `max_in_flight_per_key` is full.
    KeyInFlight,
    /// A capped route without a queue was full.
    InFlight,
    /// A capped route stayed full for its `queue_timeout`, or its queue was full.
    RouteBusy,
    /// The store is down and `on_error: deny`.
    StoreUnavailable,
    Unauthenticated,
    BadPath,
    /// Malformed otherwise (HTTP/1.1 without `Host`).
    BadRequest,
    /// An async request's body over `max_request_body`.
    PayloadTooLarge,
}

impl Reason {
    /// Every reason, for tests that check the set against DESIGN §5.
    pub const ALL: [Reason; 10] = [
        Reason::Budget,
        Reason::SharedBudget,
        Reason::KeyInFlight,
        Reason::InFlight,
        Reason::RouteBusy,
        Reason::StoreUnavailable,
        Reason::Unauthenticated,
        Reason::BadPath,
        Reason::BadRequest,
        Reason::PayloadTooLarge,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::Budget => "budget",
            Reason::SharedBudget => "shared_budget",
            Reason::KeyInFlight => "key_in_flight",
            Reason::InFlight => "in_flight",
            Reason::RouteBusy => "route_busy",
            Reason::StoreUnavailable => "store_unavailable",
            Reason::Unauthenticated => "unauthenticated",
            Reason::BadPath => "bad_path",
            Reason::BadRequest => "bad_request",
            Reason::PayloadTooLarge => "payload_too_large",
        }
    }

    /// The rate limiter's own decisions (the budgets', the in-flight caps' and `on_error:
    /// deny`'s), which `mode: shadow` forwards instead of refusing. Who the caller is and
    /// whether the path is safe to classify are enforced in every mode: they come before a
    /// route's mode is even known to apply (nobody to charge, or no route to charge as).
    pub const fn shadowable(self) -> bool {
        matches!(
            self,
            Reason::Budget
                | Reason::SharedBudget
                | Reason::KeyInFlight
                | Reason::InFlight
                | Reason::RouteBusy
                | Reason::StoreUnavailable
        )
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What became of a request: the access log's and the trace's `decision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Refused by the gateway: the decision is the reason.
    Refused(Reason),
    /// Answered without a decision (a refusal that is not the gateway's, or none was made).
    Error,
    Admitted,
    /// Charged, then given back: the upstream never answered.
    Refunded,
    /// The client left before the request was forwarded.
    ClientGone,
    /// `mode: shadow` forwarded a request enforcement would have refused.
    Shadow,
    /// An async job was accepted (202).
    JobSubmitted,
    JobPoll,
    JobCancel,
    /// An async job ended (its own access-log line).
    JobDone,
    JobFailed,
    JobExpired,
    JobCancelled,
}

impl Verdict {
    pub const fn as_str(self) -> &'static str {
        match self {
            Verdict::Refused(reason) => reason.as_str(),
            Verdict::Error => "error",
            Verdict::Admitted => "admitted",
            Verdict::Refunded => "refunded",
            Verdict::ClientGone => "client_gone",
            Verdict::Shadow => "shadow",
            Verdict::JobSubmitted => "job_submitted",
            Verdict::JobPoll => "job_poll",
            Verdict::JobCancel => "job_cancel",
            Verdict::JobDone => "job_done",
            Verdict::JobFailed => "job_failed",
            Verdict::JobExpired => "job_expired",
            Verdict::JobCancelled => "job_cancelled",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The labels are contract: DESIGN §5's reasons, and the ones added since.
    #[test]
    fn labels_are_the_contract() {
        assert_eq!(
            Reason::ALL.map(Reason::as_str),
            [
                "budget",
                "shared_budget",
                "key_in_flight",
                "in_flight",
                "route_busy",
                "store_unavailable",
                "unauthenticated",
                "bad_path",
                "bad_request",
                "payload_too_large",
            ]
        );
        let shadowable: Vec<_> = Reason::ALL
            .into_iter()
            .filter(|r| r.shadowable())
            .map(Reason::as_str)
            .collect();
        assert_eq!(
            shadowable,
            [
                "budget",
                "shared_budget",
                "key_in_flight",
                "in_flight",
                "route_busy",
                "store_unavailable"
            ]
        );
        assert_eq!(Verdict::Refused(Reason::BadPath).to_string(), "bad_path");
        assert_eq!(Verdict::ClientGone.as_str(), "client_gone");
        assert_eq!(Verdict::JobCancelled.as_str(), "job_cancelled");
    }
}
