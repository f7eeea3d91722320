use super::*;

#[test]
fn refunds_are_sent_again_unless_they_timed_out() {
    assert!(!refund_again(&StoreError::Timeout));
    assert!(refund_again(&StoreError::BreakerOpen));
    assert!(refund_again(&StoreError::ConnectTimeout));
    let dropped =
        redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
    assert!(refund_again(&StoreError::from(dropped)));
    let script_error = redis::RedisError::from((
        redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
        "x",
    ));
    // An error reply: the refund did not run, so it is sent again.
    assert!(refund_again(&StoreError::from(script_error)));
}
