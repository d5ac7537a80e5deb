//! Shares: what one connection, or one namespace (a tenant, or the tenants of one sharing
//! group), may take of something every client draws on, so that one slow or hostile client
//! cannot take it whole: DRAM blocks held by pins, the send budget, and connections (per
//! namespace, and per uid on a Unix socket shared with a group).
//!
//! A [`Share`] is a counter with a bound; what is taken from it is a [`Charge`], given back
//! when the charge drops (a lease released, reaped or its connection gone; a response written
//! or dropped).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A bounded amount that charges draw on.
pub(crate) struct Share {
    used: AtomicU64,
    max: u64,
}

impl Share {
    /// A share of `max` (`u64::MAX`: unbounded).
    pub fn new(max: u64) -> Arc<Self> {
        Arc::new(Self {
            used: AtomicU64::new(0),
            max,
        })
    }

    /// Takes as much of `want` as is left (possibly nothing).
    pub fn take_up_to(self: &Arc<Self>, want: u64) -> Charge {
        let mut got = 0;
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                got = want.min(self.max.saturating_sub(used));
                Some(used + got)
            });
        Charge {
            share: Some(self.clone()),
            n: got,
        }
    }

    /// Takes `n` whole, or nothing (`None`).
    pub fn try_take(self: &Arc<Self>, n: u64) -> Option<Charge> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used.saturating_add(n) <= self.max).then_some(used + n)
            })
            .ok()
            .map(|_| Charge {
                share: Some(self.clone()),
                n,
            })
    }

    /// What is taken now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

/// An amount taken from a [`Share`]; given back on drop.
pub(crate) struct Charge {
    share: Option<Arc<Share>>,
    n: u64,
}

impl Charge {
    pub fn amount(&self) -> u64 {
        self.n
    }

    /// Keeps `n` of the charge (at most what it holds) and gives the rest back.
    pub fn shrink(&mut self, n: u64) {
        let back = self.n.saturating_sub(n);
        if back > 0
            && let Some(s) = &self.share
        {
            s.used.fetch_sub(back, Ordering::AcqRel);
            self.n -= back;
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.shrink(0);
    }
}

/// Which share a request ran into (the `share` label of `kvtier_share_refusals_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ShareKind {
    /// `limits.max_pinned_blocks_per_connection`.
    PinsConnection,
    /// `limits.max_pinned_blocks_per_tenant`.
    PinsTenant,
    /// `limits.max_inflight_bytes_per_tenant`.
    SendTenant,
    /// `limits.max_connections_per_tenant`.
    ConnectionsTenant,
    /// `limits.max_unix_connections_per_uid`.
    ConnectionsUid,
}

impl ShareKind {
    pub const ALL: [ShareKind; 5] = [
        ShareKind::PinsConnection,
        ShareKind::PinsTenant,
        ShareKind::SendTenant,
        ShareKind::ConnectionsTenant,
        ShareKind::ConnectionsUid,
    ];
    pub fn name(self) -> &'static str {
        match self {
            ShareKind::PinsConnection => "pins_connection",
            ShareKind::PinsTenant => "pins_tenant",
            ShareKind::SendTenant => "send_tenant",
            ShareKind::ConnectionsTenant => "connections_tenant",
            ShareKind::ConnectionsUid => "connections_uid",
        }
    }
}

/// Each namespace's shares (one namespace without tenants).
pub(crate) struct NamespaceShares {
    /// DRAM blocks its connections' pins hold.
    pins: Vec<Arc<Share>>,
    /// Send budget units ([`super::conn::BUDGET_UNIT`]) its connections' gets hold.
    send: Vec<Arc<Share>>,
    /// Its connections that have said hello.
    conns: Vec<Arc<Share>>,
    /// DRAM blocks one connection's pins may hold.
    pub pins_per_connection: u64,
    /// A share without a bound, for what no share limits.
    unbounded: Arc<Share>,
}

impl NamespaceShares {
    /// `namespaces` namespaces, each allowed `pins` pinned blocks, `send` send units and
    /// `conns` connections.
    pub fn new(
        namespaces: usize,
        pins_per_connection: u64,
        pins: u64,
        send: u64,
        conns: u64,
    ) -> Self {
        Self {
            pins: (0..namespaces).map(|_| Share::new(pins)).collect(),
            send: (0..namespaces).map(|_| Share::new(send)).collect(),
            conns: (0..namespaces).map(|_| Share::new(conns)).collect(),
            pins_per_connection,
            unbounded: Share::new(u64::MAX),
        }
    }

    /// A share without a bound.
    pub fn unbounded(&self) -> &Arc<Share> {
        &self.unbounded
    }

    /// The connection share of namespace `ns`.
    pub fn conns(&self, ns: usize) -> &Arc<Share> {
        &self.conns[ns.min(self.conns.len() - 1)]
    }

    /// The pin share of namespace `ns`.
    pub fn pins(&self, ns: usize) -> &Arc<Share> {
        &self.pins[ns.min(self.pins.len() - 1)]
    }

    /// The send share of namespace `ns`.
    pub fn send(&self, ns: usize) -> &Arc<Share> {
        &self.send[ns.min(self.send.len() - 1)]
    }
}

/// Uids with more than this many entries are forgotten when they hold no connection.
const UIDS_KEPT: usize = 1024;

/// Unix socket connections per uid (`server.unix_group`): a group member's share, so that it
/// cannot fill the places kept for the local worker. The server's own uid has none.
pub(crate) struct UidShares {
    /// `None`: no group, no cap.
    max: Option<u64>,
    own_uid: u32,
    by_uid: Mutex<HashMap<u32, Arc<Share>>>,
}

impl UidShares {
    pub fn new(max: Option<u64>, own_uid: u32) -> Self {
        Self {
            max,
            own_uid,
            by_uid: Mutex::new(HashMap::new()),
        }
    }

    /// A place for one more connection of `uid`: `Ok(None)` where no cap applies (no group,
    /// the server's own uid), `Err(())` past the cap.
    pub fn admit(&self, uid: Option<u32>) -> Result<Option<Charge>, ()> {
        let Some(max) = self.max else { return Ok(None) };
        // A peer whose credentials could not be read is capped as one uid (u32::MAX).
        let uid = uid.unwrap_or(u32::MAX);
        if uid == self.own_uid {
            return Ok(None);
        }
        let share = {
            let mut m = self.by_uid.lock().unwrap_or_else(|p| p.into_inner());
            if m.len() >= UIDS_KEPT {
                m.retain(|_, s| s.used() > 0);
            }
            m.entry(uid).or_insert_with(|| Share::new(max)).clone()
        };
        share.try_take(1).map(Some).ok_or(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_is_taken_up_to_its_bound_and_given_back_on_drop() {
        let s = Share::new(10);
        let a = s.take_up_to(7);
        assert_eq!(a.amount(), 7);
        let b = s.take_up_to(7);
        assert_eq!(b.amount(), 3, "only what is left");
        assert_eq!(s.take_up_to(1).amount(), 0);
        assert!(s.try_take(1).is_none());
        drop(a);
        assert_eq!(s.used(), 3);
        assert!(s.try_take(7).is_some_and(|c| c.amount() == 7));
        assert_eq!(s.used(), 3, "the dropped charge came back");
    }

    #[test]
    fn a_charge_shrinks_to_what_was_used() {
        let s = Share::new(10);
        let mut c = s.take_up_to(8);
        c.shrink(5);
        assert_eq!((c.amount(), s.used()), (5, 5));
        c.shrink(9);
        assert_eq!((c.amount(), s.used()), (5, 5), "never grows");
        drop(c);
        assert_eq!(s.used(), 0);
    }

    #[test]
    fn a_uid_is_capped_apart_from_the_servers_own() {
        let u = UidShares::new(Some(2), 1000);
        let a = u.admit(Some(1001)).unwrap();
        let _b = u.admit(Some(1001)).unwrap();
        assert!(u.admit(Some(1001)).is_err(), "its third");
        assert!(
            u.admit(Some(1002)).unwrap().is_some(),
            "another uid has its own"
        );
        for _ in 0..10 {
            assert!(
                u.admit(Some(1000)).unwrap().is_none(),
                "the server's uid: no cap"
            );
        }
        drop(a);
        assert!(
            u.admit(Some(1001)).is_ok(),
            "a closed one gives its place back"
        );
        let none = UidShares::new(None, 1000);
        assert!(
            none.admit(Some(1001)).unwrap().is_none(),
            "no group: no cap"
        );
    }

    #[test]
    fn an_unbounded_share_never_refuses() {
        let s = Share::new(u64::MAX);
        let _a = s.take_up_to(u64::MAX / 2);
        assert!(s.try_take(u64::MAX / 2).is_some());
    }
}
