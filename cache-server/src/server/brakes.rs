//! Brakes on what unauthenticated or misbehaving peers can cost the server: a token bucket of
//! failed hellos per peer address, connections before hello counted apart (with their own
//! cap), the token compared in constant time, and warnings rate-limited.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use subtle::ConstantTimeEq;

/// Peers whose failed hellos are remembered at once; past it, buckets that have refilled are
/// forgotten, and if none has, a hello from a new peer is refused as throttled (fail closed:
/// spraying addresses must not reset the brake).
const MAX_TRACKED_PEERS: usize = 65_536;

/// How often a kind of warning is logged at most (with the count since the last one).
pub(crate) const LOG_INTERVAL: Duration = Duration::from_secs(10);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The address a failed hello is charged to: an IPv4 address, or an IPv6 /64 (one host
/// usually holds a whole /64, so charging single addresses would not brake it).
fn peer_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// A token bucket of failed hellos per peer: each failure takes a token; a peer with none
/// left is refused before its token is even compared, until the bucket refills.
pub(crate) struct AuthThrottle {
    burst: f64,
    per_sec: f64,
    peers: Mutex<HashMap<IpAddr, Bucket>>,
}

/// Whether a peer may try a hello now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum AuthGate {
    Open,
    /// Throttled: the next attempt is allowed in about this long.
    Throttled(Duration),
}

impl AuthThrottle {
    /// `burst` failures at once, then `per_minute` more a minute.
    pub fn new(burst: u32, per_minute: u32) -> Self {
        Self {
            burst: f64::from(burst),
            per_sec: f64::from(per_minute) / 60.0,
            peers: Mutex::new(HashMap::new()),
        }
    }

    fn refill(&self, b: &mut Bucket, now: Instant) {
        let dt = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + dt * self.per_sec).min(self.burst);
        b.at = now;
    }

    fn wait(&self, tokens: f64) -> Duration {
        if self.per_sec <= 0.0 {
            return Duration::MAX;
        }
        Duration::from_secs_f64(((1.0 - tokens) / self.per_sec).max(0.0))
    }

    /// Whether `ip` may try a hello now (charges nothing).
    pub fn gate(&self, ip: IpAddr, now: Instant) -> AuthGate {
        let mut peers = lock(&self.peers);
        let full = peers.len() >= MAX_TRACKED_PEERS;
        match peers.get_mut(&peer_key(ip)) {
            Some(b) => {
                self.refill(b, now);
                if b.tokens >= 1.0 {
                    AuthGate::Open
                } else {
                    AuthGate::Throttled(self.wait(b.tokens))
                }
            }
            None if full => {
                // Full of peers still being braked: do not let a new one in unbraked.
                AuthGate::Throttled(self.wait(0.0))
            }
            None => AuthGate::Open,
        }
    }

    /// Charges a failed hello to `ip`.
    pub fn failed(&self, ip: IpAddr, now: Instant) {
        let mut peers = lock(&self.peers);
        if peers.len() >= MAX_TRACKED_PEERS {
            let full = self.burst;
            let per_sec = self.per_sec;
            peers.retain(|_, b| {
                let dt = now.saturating_duration_since(b.at).as_secs_f64();
                b.tokens + dt * per_sec < full
            });
        }
        if peers.len() >= MAX_TRACKED_PEERS {
            return; // gate() refuses new peers while full
        }
        let b = peers.entry(peer_key(ip)).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        self.refill(b, now);
        b.tokens = (b.tokens - 1.0).max(0.0);
    }
}

/// The SHA-256 digest of a token: tokens are compared by digest, in constant time, so the
/// time a comparison takes depends on neither the token's length nor where it differs.
pub(crate) fn token_digest(token: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, token);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Whether `presented` is the token whose digest is `expected`.
pub(crate) fn token_matches(presented: &[u8], expected: &[u8; 32]) -> bool {
    bool::from(token_digest(presented).ct_eq(expected))
}

/// A warning logged at most once per [`LOG_INTERVAL`], with how many happened since.
#[derive(Default)]
pub(crate) struct RateLimitedLog {
    state: Mutex<(Option<Instant>, u64)>,
}

impl RateLimitedLog {
    /// Counts one occurrence; `Some(count since the last log)` when it is time to log.
    pub fn tick(&self, now: Instant) -> Option<u64> {
        let mut s = lock(&self.state);
        s.1 += 1;
        match s.0 {
            Some(last) if now.saturating_duration_since(last) < LOG_INTERVAL => None,
            _ => {
                let n = s.1;
                *s = (Some(now), 0);
                Some(n)
            }
        }
    }
}

/// Network connections that have not said hello yet, counted apart from the others with
/// their own cap.
pub(crate) struct PreHello {
    open: AtomicUsize,
    max: usize,
}

/// One connection's place among those before hello; given back on drop (or at hello).
pub(crate) struct PreHelloSlot(Arc<PreHello>);

impl PreHello {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            open: AtomicUsize::new(0),
            max,
        })
    }

    /// A place, or `None` when `max` connections are already waiting for their hello.
    pub fn admit(self: &Arc<Self>) -> Option<PreHelloSlot> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| PreHelloSlot(self.clone()))
    }

    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

impl Drop for PreHelloSlot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Raises this process's soft limit on open file descriptors to its hard limit (as Go's
/// runtime and most servers do: the soft limit's usual 1,024 would cap connections below
/// `limits.max_connections`); returns the limit now in force.
pub fn raise_nofile_limit() -> std::io::Result<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we pass, which lives on our stack.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if r.rlim_cur < r.rlim_max {
        let want = libc::rlimit {
            rlim_cur: r.rlim_max,
            rlim_max: r.rlim_max,
        };
        // SAFETY: setrlimit reads one rlimit from the struct we pass.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        r.rlim_cur = r.rlim_max;
    }
    Ok(r.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_fd_limit_is_raised_to_the_hard_one() {
        let now = raise_nofile_limit().unwrap();
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: as in raise_nofile_limit.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
        assert_eq!((r.rlim_cur, r.rlim_max), (now, now));
    }

    #[test]
    fn a_peer_is_braked_after_its_burst_and_refills() {
        let t = AuthThrottle::new(3, 60); // one a second
        let ip: IpAddr = "192.0.2.7".parse().unwrap();
        let other: IpAddr = "192.0.2.8".parse().unwrap();
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(t.gate(ip, t0), AuthGate::Open);
            t.failed(ip, t0);
        }
        assert!(matches!(t.gate(ip, t0), AuthGate::Throttled(d) if d <= Duration::from_secs(1)));
        assert_eq!(t.gate(other, t0), AuthGate::Open, "others are not braked");
        let later = t0 + Duration::from_millis(1100);
        assert_eq!(t.gate(ip, later), AuthGate::Open, "one token back");
        t.failed(ip, later);
        assert!(matches!(t.gate(ip, later), AuthGate::Throttled(_)));
    }

    #[test]
    fn an_ipv6_host_is_charged_by_its_64() {
        let t = AuthThrottle::new(2, 0);
        let now = Instant::now();
        t.failed("2001:db8::1".parse().unwrap(), now);
        t.failed("2001:db8::2".parse().unwrap(), now);
        assert!(matches!(
            t.gate("2001:db8::ffff".parse().unwrap(), now),
            AuthGate::Throttled(_)
        ));
        assert_eq!(
            t.gate("2001:db8:0:1::1".parse().unwrap(), now),
            AuthGate::Open
        );
    }

    #[test]
    fn tokens_compare_by_digest() {
        let d = token_digest(b"secret");
        assert!(token_matches(b"secret", &d));
        for wrong in [&b""[..], b"secre", b"secreT", b"secret\0", &[b'x'; 1024]] {
            assert!(!token_matches(wrong, &d), "{wrong:?}");
        }
    }

    #[test]
    fn warnings_are_rate_limited_with_a_count() {
        let l = RateLimitedLog::default();
        let t0 = Instant::now();
        assert_eq!(l.tick(t0), Some(1));
        assert_eq!(l.tick(t0), None);
        assert_eq!(l.tick(t0 + Duration::from_secs(1)), None);
        assert_eq!(l.tick(t0 + LOG_INTERVAL + Duration::from_secs(1)), Some(3));
    }

    #[test]
    fn pre_hello_places_are_capped_and_given_back() {
        let p = PreHello::new(2);
        let a = p.admit().unwrap();
        let _b = p.admit().unwrap();
        assert!(p.admit().is_none());
        drop(a);
        assert_eq!(p.open(), 1);
        assert!(p.admit().is_some());
    }
}
