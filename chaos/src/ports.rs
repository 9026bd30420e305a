//! Ports a test hands to a process that binds them itself (a replica's `zmqEndpoint`, given to
//! the simulated pods before the replica starts).

use std::collections::BTreeSet;
use std::sync::Mutex;

/// Ports handed out by this process so far (tests run in parallel threads).
static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// A free loopback port for a process to bind later, taken below the kernel's ephemeral range
/// (`/proc/sys/net/ipv4/ip_local_port_range`, 32768–60999 by default): between this check and
/// that bind, no OS-chosen port — any `:0` bind, any outgoing connection's local port — can take
/// it, as one released from a `:0` bind could be.
pub fn for_later_bind() -> std::io::Result<u16> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (from, to) = (10_000u16, low.max(11_000));
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
        ^ std::process::id();
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    let span = u32::from(to - from);
    for i in 0..span {
        let port = from + ((seed.wrapping_add(i.wrapping_mul(7919))) % span) as u16;
        if given.contains(&port) {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.insert(port);
            return Ok(port);
        }
    }
    Err(std::io::Error::other(
        "no free loopback port below the ephemeral range",
    ))
}
