//! The membership view: the live members as this node last saw them in etcd, and whether
//! it still sees etcd. A state machine with no I/O and no clock of its own: the etcd driver
//! (`etcd.rs`) feeds it a listing, watch changes and connection news with the time, and
//! tests feed it the same by hand.
//!
//! **Invariant:** the view only changes through [`MembershipView::reset`] (a full listing at
//! a revision), [`MembershipView::apply`] (one watch change at a later revision) and
//! [`MembershipView::disconnected`] (which keeps the members: etcd unreachable means the
//! last known view, never an empty one).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::placement::{Candidate, Placement, Splits};
use super::record::{MemberRecord, RecordSealer, Rejection};

/// A member in the view: its record and the etcd facts about its key.
#[derive(Clone, Debug, PartialEq)]
pub struct Member {
    pub record: MemberRecord,
    /// The etcd lease its key lives under (0: none).
    pub lease_id: i64,
    /// The etcd revision of its key's last change.
    pub mod_revision: i64,
}

/// Whether this node sees etcd.
#[derive(Clone, Debug, PartialEq)]
pub enum EtcdLink {
    /// Not yet listed the members once.
    Connecting,
    /// Registered, listing done, watching.
    Connected { since: Instant },
    /// Lost; the members are the last known ones.
    Unreachable { since: Instant, error: String },
}

/// One key of a listing of the member prefix: (key, value, lease, mod revision).
pub type ListedKey = (Vec<u8>, Vec<u8>, i64, i64);

/// A watch change, as the driver reads it from etcd.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        lease_id: i64,
        mod_revision: i64,
    },
    Delete {
        key: Vec<u8>,
        mod_revision: i64,
    },
}

/// What one change did to the view.
#[derive(Clone, Debug, PartialEq)]
pub enum Applied {
    Joined(String),
    Updated(String),
    Left(String),
    /// A record that did not verify (not in the view; a member it replaced is removed).
    Rejected(String, Rejection),
    /// Not a member key, an older revision than the view's, or a delete of an unknown id.
    Ignored,
}

/// The view of one node. See the module doc.
#[derive(Debug)]
pub struct MembershipView {
    prefix: Vec<u8>,
    sealer: RecordSealer,
    replicas: usize,
    members: BTreeMap<String, Member>,
    /// The etcd revision the view reflects.
    revision: i64,
    link: EtcdLink,
    /// Records refused since start, by reason.
    rejected: BTreeMap<&'static str, u64>,
    /// Membership changes since start (joins, leaves, updates; listings that differ).
    changes: u64,
    placement: Placement,
    /// The union of the members' published splits (rebuilt at each change).
    splits: Arc<Splits>,
}

impl MembershipView {
    /// An empty view of the member keys under `prefix` (ending in `/`).
    pub fn new(prefix: impl Into<Vec<u8>>, sealer: RecordSealer, replicas: usize) -> Self {
        Self {
            prefix: prefix.into(),
            sealer,
            replicas,
            members: BTreeMap::new(),
            revision: 0,
            link: EtcdLink::Connecting,
            rejected: BTreeMap::new(),
            changes: 0,
            placement: Placement::new([], replicas),
            splits: Arc::default(),
        }
    }

    pub fn members(&self) -> &BTreeMap<String, Member> {
        &self.members
    }

    pub fn link(&self) -> &EtcdLink {
        &self.link
    }

    pub fn revision(&self) -> i64 {
        self.revision
    }

    pub fn changes(&self) -> u64 {
        self.changes
    }

    pub fn rejected(&self) -> &BTreeMap<&'static str, u64> {
        &self.rejected
    }

    /// Placement over the members in the view (rebuilt at each change).
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// The splits every member places by: the union of those the members publish (at most
    /// `shared::MAX_PUBLISHED` of each record; entries that do not parse are skipped).
    pub fn splits(&self) -> &Arc<Splits> {
        &self.splits
    }

    /// How long etcd has been unreachable, if it is.
    pub fn unreachable_for(&self, now: Instant) -> Option<Duration> {
        match &self.link {
            EtcdLink::Unreachable { since, .. } => Some(now.saturating_duration_since(*since)),
            _ => None,
        }
    }

    fn node_id<'a>(&self, key: &'a [u8]) -> Option<&'a str> {
        let id = std::str::from_utf8(key.strip_prefix(self.prefix.as_slice())?).ok()?;
        (!id.is_empty() && !id.contains('/')).then_some(id)
    }

    fn rebuild(&mut self) {
        self.placement = Placement::new(
            self.members
                .values()
                .map(|m| Candidate::new(m.record.node_id.clone(), m.record.weight())),
            self.replicas,
        );
        self.splits = Arc::new(Splits::new(self.members.values().flat_map(|m| {
            m.record
                .splits
                .iter()
                .take(super::shared::MAX_PUBLISHED)
                .filter_map(|s| s.parse())
        })));
    }

    fn reject(&mut self, id: &str, why: Rejection) -> Applied {
        *self.rejected.entry(why.name()).or_default() += 1;
        Applied::Rejected(id.to_string(), why)
    }

    /// Replaces the members with a full listing taken at `revision` (`(key, value, lease,
    /// mod_revision)` per key), and marks etcd connected. Returns what the listing refused.
    pub fn reset(
        &mut self,
        revision: i64,
        kvs: impl IntoIterator<Item = (Vec<u8>, Vec<u8>, i64, i64)>,
        now: Instant,
    ) -> Vec<Applied> {
        let mut next = BTreeMap::new();
        let mut refused = Vec::new();
        for (key, value, lease_id, mod_revision) in kvs {
            let Some(id) = self.node_id(&key).map(str::to_string) else {
                continue;
            };
            match self.sealer.open(&key, &id, &value) {
                Ok(record) => {
                    next.insert(
                        id,
                        Member {
                            record,
                            lease_id,
                            mod_revision,
                        },
                    );
                }
                Err(why) => refused.push(self.reject(&id, why)),
            }
        }
        if next != self.members {
            self.changes += 1;
        }
        self.members = next;
        self.revision = revision;
        self.link = EtcdLink::Connected { since: now };
        self.rebuild();
        refused
    }

    /// Applies one watch change. Changes at or below the view's revision are ignored (a
    /// listing already holds them).
    pub fn apply(&mut self, change: Change) -> Applied {
        let (key, rev) = match &change {
            Change::Put {
                key, mod_revision, ..
            }
            | Change::Delete {
                key, mod_revision, ..
            } => (key, *mod_revision),
        };
        if rev <= self.revision {
            return Applied::Ignored;
        }
        let Some(id) = self.node_id(key).map(str::to_string) else {
            return Applied::Ignored;
        };
        self.revision = rev;
        let out = match change {
            Change::Delete { .. } => match self.members.remove(&id) {
                Some(_) => Applied::Left(id),
                None => Applied::Ignored,
            },
            Change::Put {
                key,
                value,
                lease_id,
                mod_revision,
            } => match self.sealer.open(&key, &id, &value) {
                Ok(record) => {
                    let m = Member {
                        record,
                        lease_id,
                        mod_revision,
                    };
                    match self.members.insert(id.clone(), m) {
                        None => Applied::Joined(id),
                        Some(_) => Applied::Updated(id),
                    }
                }
                Err(why) => {
                    // A refused record replaces whatever was there: etcd no longer holds it.
                    self.members.remove(&id);
                    self.reject(&id, why)
                }
            },
        };
        if !matches!(out, Applied::Ignored) {
            self.changes += 1;
            self.rebuild();
        }
        out
    }

    /// etcd is unreachable (a request, the keep-alive or the watch failed): the members
    /// stay as last seen.
    pub fn disconnected(&mut self, now: Instant, error: impl Into<String>) {
        let error = error.into();
        self.link = match &self.link {
            EtcdLink::Unreachable { since, .. } => EtcdLink::Unreachable {
                since: *since,
                error,
            },
            _ => EtcdLink::Unreachable { since: now, error },
        };
    }
}

#[cfg(test)]
mod tests {
    use super::super::record::tests::record;
    use super::*;

    const PREFIX: &str = "/kvtier/c/members/";

    fn key(id: &str) -> Vec<u8> {
        format!("{PREFIX}{id}").into_bytes()
    }

    fn put(s: &RecordSealer, id: &str, rev: i64) -> Change {
        Change::Put {
            key: key(id),
            value: s.seal(&key(id), &record(id)),
            lease_id: 7,
            mod_revision: rev,
        }
    }

    fn del(id: &str, rev: i64) -> Change {
        Change::Delete {
            key: key(id),
            mod_revision: rev,
        }
    }

    fn ids(v: &MembershipView) -> Vec<&str> {
        v.members().keys().map(String::as_str).collect()
    }

    /// Table of changes after a listing of {a, b} at revision 10: what each does, and the
    /// members after it.
    #[test]
    fn changes_after_a_listing() {
        let s = RecordSealer::new(Some(b"k"), "c");
        let stranger = RecordSealer::new(Some(b"not the secret"), "c");
        let now = Instant::now();
        let mut v = MembershipView::new(PREFIX, s.clone(), 1);
        assert_eq!(v.link(), &EtcdLink::Connecting);
        let listing = ["a", "b"].map(|id| (key(id), s.seal(&key(id), &record(id)), 7, 5));
        assert!(v.reset(10, listing, now).is_empty());
        assert_eq!(ids(&v), ["a", "b"]);
        let table: Vec<(Change, Applied, Vec<&str>)> = vec![
            (put(&s, "c", 9), Applied::Ignored, vec!["a", "b"]),
            (
                put(&s, "c", 11),
                Applied::Joined("c".into()),
                vec!["a", "b", "c"],
            ),
            (
                put(&s, "c", 12),
                Applied::Updated("c".into()),
                vec!["a", "b", "c"],
            ),
            (del("b", 13), Applied::Left("b".into()), vec!["a", "c"]),
            (del("b", 14), Applied::Ignored, vec!["a", "c"]),
            (
                put(&stranger, "evil", 15),
                Applied::Rejected("evil".into(), Rejection::BadMac),
                vec!["a", "c"],
            ),
            (
                put(&stranger, "a", 16),
                Applied::Rejected("a".into(), Rejection::BadMac),
                vec!["c"],
            ),
            (
                Change::Put {
                    key: b"/kvtier/c/other".to_vec(),
                    value: vec![],
                    lease_id: 0,
                    mod_revision: 17,
                },
                Applied::Ignored,
                vec!["c"],
            ),
            (
                Change::Put {
                    key: key("x/y"),
                    value: vec![],
                    lease_id: 0,
                    mod_revision: 18,
                },
                Applied::Ignored,
                vec!["c"],
            ),
        ];
        for (change, want, members) in table {
            let got = v.apply(change.clone());
            assert_eq!(got, want, "{change:?}");
            assert_eq!(ids(&v), members, "{change:?}");
        }
        assert_eq!(v.rejected().get("bad_mac"), Some(&2));
        let owners: Vec<String> = v
            .placement()
            .members()
            .iter()
            .map(|m| m.id.clone())
            .collect();
        assert_eq!(owners, ["c"]);
    }

    #[test]
    fn unreachable_keeps_the_last_view_and_a_listing_reconnects() {
        let s = RecordSealer::new(None, "c");
        let t0 = Instant::now();
        let mut v = MembershipView::new(PREFIX, s.clone(), 2);
        let listing = ["a", "b"].map(|id| (key(id), s.seal(&key(id), &record(id)), 1, 2));
        v.reset(3, listing, t0);
        v.disconnected(t0 + Duration::from_secs(1), "connection refused");
        v.disconnected(t0 + Duration::from_secs(5), "still refused");
        assert_eq!(ids(&v), ["a", "b"]);
        assert_eq!(v.placement().members().len(), 2);
        assert_eq!(
            v.unreachable_for(t0 + Duration::from_secs(6)),
            Some(Duration::from_secs(5)),
            "the outage is counted from its first failure"
        );
        // etcd back: b is gone (its lease expired meanwhile), c joined.
        let listing = ["a", "c"].map(|id| (key(id), s.seal(&key(id), &record(id)), 1, 20));
        let changes = v.changes();
        v.reset(21, listing, t0 + Duration::from_secs(7));
        assert_eq!(ids(&v), ["a", "c"]);
        assert!(matches!(v.link(), EtcdLink::Connected { .. }));
        assert_eq!(v.unreachable_for(t0 + Duration::from_secs(8)), None);
        assert_eq!(v.changes(), changes + 1);
        // A watch change the new listing already holds is ignored.
        assert_eq!(v.apply(del("a", 21)), Applied::Ignored);
    }

    /// The view's splits are the union of the members' (bad entries skipped, at most
    /// MAX_PUBLISHED a record), and go with the member that published them.
    #[test]
    fn splits_are_the_union_of_the_members() {
        use super::super::record::SplitRecord;
        use kvtier_core::BlockKey;
        let s = RecordSealer::new(Some(b"k"), "c");
        let mut v = MembershipView::new(PREFIX, s.clone(), 1);
        let k = |n: u128| BlockKey::from_u128(n);
        let with = |id: &str, splits: Vec<SplitRecord>, rev: i64| {
            let mut r = record(id);
            r.splits = splits;
            Change::Put {
                key: key(id),
                value: s.seal(&key(id), &r),
                lease_id: 7,
                mod_revision: rev,
            }
        };
        v.apply(with(
            "a",
            vec![SplitRecord::new(0, &k(1)), SplitRecord::new(3, &k(2))],
            1,
        ));
        let bad = SplitRecord {
            position: 1,
            key: "not hex".into(),
        };
        v.apply(with("b", vec![SplitRecord::new(0, &k(1)), bad], 2));
        let got: Vec<(usize, BlockKey)> = v.splits().iter().copied().collect();
        assert_eq!(got, vec![(0, k(1)), (3, k(2))]);
        v.apply(del("a", 3));
        let got: Vec<(usize, BlockKey)> = v.splits().iter().copied().collect();
        assert_eq!(got, vec![(0, k(1))]);
        let many = (0..100)
            .map(|i| SplitRecord::new(5, &k(1000 + i)))
            .collect();
        v.apply(with("b", many, 4));
        assert_eq!(v.splits().len(), super::super::shared::MAX_PUBLISHED);
    }
}
