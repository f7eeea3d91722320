//! How `tollgate check` and `explain` describe a route's `async:` block.

use crate::config::duration::format_duration;
use crate::config::size::format_size;
use crate::route::{AsyncRules, Router};

fn when(r: &AsyncRules) -> &'static str {
    if r.always {
        "always"
    } else {
        "prefer"
    }
}

/// `check`'s table of async routes (header first); `None` when no route is async.
pub fn check_rows(router: &Router) -> Option<Vec<[String; 5]>> {
    let mut rows = vec![[
        "ASYNC ROUTE".to_string(),
        "WHEN".into(),
        "RESULT_TTL".into(),
        "MAX_REQUEST_BODY".into(),
        "MAX_RESPONSE_BODY".into(),
    ]];
    for r in router.routes() {
        if let Some(j) = &r.jobs {
            rows.push([
                r.label.to_string(),
                when(j).into(),
                format_duration(j.result_ttl),
                format_size(j.max_request_body),
                format_size(j.max_response_body),
            ]);
        }
    }
    (rows.len() > 1).then_some(rows)
}

/// `explain`'s line for an async route.
pub fn explain_line(j: &AsyncRules) -> String {
    let who = if j.always {
        "every request"
    } else {
        "a request with Prefer: respond-async"
    };
    format!(
        "async:        {who} becomes a job (202, Location /_tollgate/jobs/<id>); result kept {}; body at most {} (413 beyond), answer at most {}",
        format_duration(j.result_ttl),
        format_size(j.max_request_body),
        format_size(j.max_response_body)
    )
}
