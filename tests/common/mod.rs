//! Test harness: the real gateway binary, a real HTTP upstream (the sample API, in-process) and
//! real `redis-server` processes, each on free loopback ports and stopped on drop.
//!
//! One job a module; all of it is re-exported here, so that a test says `use common::*`.
// Each test file uses some of the harness: the rest would warn there.
#![allow(dead_code)]

pub mod otlp;

mod client;
mod fixtures;
mod gateway;
mod jobs;
mod load;
mod pki;
mod process;
mod raw_http;
mod redis_cluster;
mod redis_sentinel;
mod redis_server;
mod tcp_proxy;
mod upstream;
mod wait;

#[allow(unused_imports)]
pub use self::{
    client::*, fixtures::*, gateway::*, jobs::*, load::*, pki::*, process::*, raw_http::*,
    redis_cluster::*, redis_sentinel::*, redis_server::*, tcp_proxy::*, upstream::*, wait::*,
};
