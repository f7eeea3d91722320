//! The closed label sets of the process-wide metrics (DESIGN §5), each value spelled once: a
//! label typed out at the call site compiles with a typo, and the typo is a new series.
//! Rejection reasons and decisions are `crate::reason`'s; job results and states are
//! `crate::jobs`'.

/// Declares a label enum with its `ALL` (for the series made at zero) and `as_str`.
macro_rules! labels {
    ($(#[$doc:meta])* $name:ident { $($variant:ident => $value:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($variant),+
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $value),+
                }
            }
        }
    };
}

labels! {
    /// `tollgate_store_calls_total{result}`.
    StoreCall {
        Ok => "ok",
        Error => "error",
        Timeout => "timeout",
        BreakerOpen => "breaker_open",
    }
}

labels! {
    /// `tollgate_config_reloads_total{result}`.
    Reload {
        Ok => "ok",
        Error => "error",
    }
}

labels! {
    /// `tollgate_client_timeouts_total{kind}`: which of the client's deadlines passed.
    ClientTimeout {
        Header => "header",
        Body => "body",
        Send => "send",
    }
}

labels! {
    /// `tollgate_accept_backoff_total{listener}`.
    Listener {
        Proxy => "proxy",
        Admin => "admin",
    }
}

labels! {
    /// `tollgate_fallback_decisions_total{decision}`: what `store.on_error` decided.
    FallbackDecision {
        Admitted => "admitted",
        Rejected => "rejected",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_contract() {
        let all = |v: &[&'static str]| v.to_vec();
        assert_eq!(
            StoreCall::ALL
                .iter()
                .map(|l| l.as_str())
                .collect::<Vec<_>>(),
            all(&["ok", "error", "timeout", "breaker_open"])
        );
        assert_eq!(
            Reload::ALL.iter().map(|l| l.as_str()).collect::<Vec<_>>(),
            all(&["ok", "error"])
        );
        assert_eq!(
            ClientTimeout::ALL
                .iter()
                .map(|l| l.as_str())
                .collect::<Vec<_>>(),
            all(&["header", "body", "send"])
        );
        assert_eq!(
            Listener::ALL.iter().map(|l| l.as_str()).collect::<Vec<_>>(),
            all(&["proxy", "admin"])
        );
        assert_eq!(
            FallbackDecision::ALL
                .iter()
                .map(|l| l.as_str())
                .collect::<Vec<_>>(),
            all(&["admitted", "rejected"])
        );
    }
}
