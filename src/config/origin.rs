//! Where a request comes from: the peer, or — behind a trusted load balancer — the client it
//! forwarded for (`identity.trusted_proxies`). Plain data the config builds.

use std::net::IpAddr;

use http::{HeaderMap, HeaderName};

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// `identity.trusted_proxies`: the proxies (load balancers) whose `X-Forwarded-For` is
/// believed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies(Vec<ipnet::IpNet>);

impl TrustedProxies {
    pub fn new(nets: Vec<ipnet::IpNet>) -> TrustedProxies {
        TrustedProxies(nets)
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.0.iter().any(|n| n.contains(&ip))
    }

    /// Where a request from `peer` comes from. Only a trusted peer's `X-Forwarded-For` is
    /// read: from its right end (the hop nearest to us), the first address that is not itself
    /// a trusted proxy is the client. Anything further left was written by that client and
    /// proves nothing. An entry that is not an address stops the walk at the last trusted hop.
    pub fn origin(&self, peer: IpAddr, headers: &HeaderMap) -> Origin {
        let peer = peer.to_canonical();
        if !self.contains(peer) {
            return Origin {
                peer,
                client: peer,
                trusted_peer: false,
            };
        }
        let mut client = peer;
        let hops = headers
            .get_all(X_FORWARDED_FOR)
            .iter()
            .rev()
            .flat_map(|v| v.as_bytes().rsplit(|b| *b == b','))
            .filter(|hop| !hop.trim_ascii().is_empty());
        for hop in hops {
            let Some(ip) = parse_hop(hop) else { break };
            client = ip;
            if !self.contains(ip) {
                break;
            }
        }
        Origin {
            peer,
            client,
            trusted_peer: true,
        }
    }
}

/// One `X-Forwarded-For` entry: an address, possibly with a port (`1.2.3.4:80`, `[::1]:80`).
fn parse_hop(hop: &[u8]) -> Option<IpAddr> {
    let s = std::str::from_utf8(hop).ok()?.trim();
    s.parse::<IpAddr>()
        .ok()
        .or_else(|| s.parse::<std::net::SocketAddr>().ok().map(|a| a.ip()))
        .map(|ip| ip.to_canonical())
}

/// `ip` as text. Once per request: IPv4 skips the formatting machinery.
pub fn ip_text(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => {
            let mut s = String::with_capacity(15);
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    s.push('.');
                }
                s.push_str(itoa::Buffer::new().format(octet));
            }
            s
        }
        IpAddr::V6(_) => ip.to_string(),
    }
}

/// Where a request comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    /// The address of the connection's other end.
    pub peer: IpAddr,
    /// The client: the peer itself, or the address a trusted proxy forwarded for.
    pub client: IpAddr,
    /// The peer is in `identity.trusted_proxies` (its forwarding headers are believed).
    pub trusted_peer: bool,
}

impl Origin {
    /// The `X-Forwarded-For` to send upstream: a trusted peer's chain with the peer appended;
    /// for any other peer, only the peer (what it claims is dropped, so the upstream cannot be
    /// told a made-up chain).
    pub fn forwarded_for(&self, received: &HeaderMap) -> String {
        let peer = ip_text(self.peer);
        if !self.trusted_peer {
            return peer;
        }
        let mut chain: Vec<&str> = received
            .get_all(X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .collect();
        chain.push(&peer);
        chain.join(", ")
    }
}
