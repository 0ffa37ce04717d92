//! Redis Cluster's slot map as pure data: which node owns each of the 16 384 slots, built from
//! a `CLUSTER SLOTS` answer and updated by a `MOVED` redirect. No connection here: the map
//! holds whatever stands for a node (the store's links; names in the tests).

use redis::Value;

/// Redis Cluster's number of hash slots.
pub const SLOTS: usize = 16_384;
const UNOWNED: u16 = u16::MAX;

/// The hash slot of a key, hash tags included (as Redis computes it).
pub fn slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|b| *b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|b| *b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tagged) % SLOTS as u16
}

/// One contiguous range of slots and its primary, as `CLUSTER SLOTS` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SlotRange {
    pub(super) start: u16,
    pub(super) end: u16,
    pub(super) host: String,
    pub(super) port: u16,
}

/// Which node owns each slot.
pub(super) struct SlotMap<N> {
    /// Index into `nodes` per slot; `UNOWNED` while no primary serves it.
    slots: Box<[u16]>,
    nodes: Vec<N>,
}

impl<N> SlotMap<N> {
    pub(super) fn empty() -> Self {
        Self {
            slots: vec![UNOWNED; SLOTS].into_boxed_slice(),
            nodes: Vec::new(),
        }
    }

    /// The map `CLUSTER SLOTS` describes: `node` gives the node for `host:port` once per
    /// distinct primary, in the order they are first listed.
    pub(super) fn from_ranges(ranges: &[SlotRange], mut node: impl FnMut(&SlotRange) -> N) -> Self
    where
        N: Clone,
    {
        let mut map = Self::empty();
        let mut names: Vec<(String, u16)> = Vec::new();
        for r in ranges {
            let name = node_name(&r.host, r.port);
            let index = match names.iter().find(|(n, _)| *n == name) {
                Some((_, i)) => *i,
                None => {
                    map.nodes.push(node(r));
                    let i = (map.nodes.len() - 1) as u16;
                    names.push((name, i));
                    i
                }
            };
            for s in r.start..=r.end.min(SLOTS as u16 - 1) {
                map.slots[s as usize] = index;
            }
        }
        map
    }

    pub(super) fn owner(&self, slot: u16) -> Option<&N> {
        let i = *self.slots.get(slot as usize)?;
        self.nodes.get(i as usize)
    }

    pub(super) fn nodes(&self) -> &[N] {
        &self.nodes
    }

    /// Slots no primary serves.
    pub(super) fn unowned(&self) -> usize {
        self.slots.iter().filter(|s| **s == UNOWNED).count()
    }

    /// The map after `MOVED slot` to `node`: that slot is `node`'s, which joins the nodes if
    /// it is new (`same` tells two nodes apart).
    pub(super) fn moved(&self, slot: u16, node: &N, same: impl Fn(&N, &N) -> bool) -> Self
    where
        N: Clone,
    {
        let mut nodes = self.nodes.clone();
        let index = match nodes.iter().position(|n| same(n, node)) {
            Some(i) => i as u16,
            None => {
                nodes.push(node.clone());
                (nodes.len() - 1) as u16
            }
        };
        let mut slots = self.slots.clone();
        if let Some(s) = slots.get_mut(slot as usize) {
            *s = index;
        }
        Self { slots, nodes }
    }

    /// Whether `other` assigns every slot to the same node (`same`) as this map.
    pub(super) fn same_as(&self, other: &Self, same: impl Fn(&N, &N) -> bool) -> bool {
        self.slots == other.slots
            && self.nodes.len() == other.nodes.len()
            && self.nodes.iter().zip(&other.nodes).all(|(a, b)| same(a, b))
    }
}

/// `CLUSTER SLOTS`: `[[start, end, [host, port, id, ...], replicas...], ...]`. An empty host
/// means the node that answered.
pub(super) fn parse_slots(reply: &Value, queried_host: &str) -> Option<Vec<SlotRange>> {
    let Value::Array(entries) = reply else {
        return None;
    };
    let int = |v: &Value| match v {
        Value::Int(i) => u16::try_from(*i).ok(),
        _ => None,
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let mut ranges = Vec::with_capacity(entries.len());
    for entry in entries {
        let Value::Array(parts) = entry else {
            return None;
        };
        let (start, end) = (int(parts.first()?)?, int(parts.get(1)?)?);
        let Value::Array(primary) = parts.get(2)? else {
            return None;
        };
        let host = text(primary.first()?)?;
        let port = int(primary.get(1)?)?;
        // "?" is a node whose address is not known yet: skip it until the next refresh.
        if host == "?" {
            continue;
        }
        let host = if host.is_empty() {
            queried_host.to_owned()
        } else {
            host
        };
        ranges.push(SlotRange {
            start,
            end,
            host,
            port,
        });
    }
    Some(ranges)
}

/// `host:port`, with brackets around an IPv6 host.
pub(super) fn node_name(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// `host:port` or `[v6]:port`, as redirects and node names write it.
pub(super) fn parse_addr(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    Some((host, port.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis() {
        // Values from `CLUSTER KEYSLOT`.
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"bar"), 5061);
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
        assert_eq!(slot(b"{user1000}.following"), slot(b"user1000"));
        // An empty tag hashes the whole key.
        assert_eq!(
            slot(b"foo{}{bar}"),
            crc16::State::<crc16::XMODEM>::calculate(b"foo{}{bar}") % 16384
        );
    }

    fn node(h: &str, p: i64) -> Value {
        Value::Array(vec![
            Value::BulkString(h.as_bytes().to_vec()),
            Value::Int(p),
            Value::BulkString(b"id".to_vec()),
        ])
    }

    fn range(start: u16, end: u16, host: &str, port: u16) -> SlotRange {
        SlotRange {
            start,
            end,
            host: host.into(),
            port,
        }
    }

    #[test]
    fn cluster_slots_replies_are_read_with_empty_hosts_filled_in() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("10.0.0.1", 7000),
                node("10.0.0.4", 7003),
            ]),
            Value::Array(vec![Value::Int(5461), Value::Int(16383), node("", 7001)]),
            Value::Array(vec![Value::Int(7), Value::Int(7), node("?", 0)]),
        ]);
        let ranges = parse_slots(&reply, "10.0.0.9").expect("parsed");
        assert_eq!(
            ranges,
            vec![
                range(0, 5460, "10.0.0.1", 7000),
                range(5461, 16383, "10.0.0.9", 7001)
            ]
        );
        assert_eq!(parse_slots(&Value::Int(1), ""), None);
    }

    fn name(r: &SlotRange) -> String {
        node_name(&r.host, r.port)
    }

    #[test]
    fn a_map_from_ranges_gives_each_slot_its_primary_once() {
        let ranges = [
            range(0, 99, "10.0.0.1", 7000),
            range(100, 199, "10.0.0.2", 7000),
            range(200, 16383, "10.0.0.1", 7000),
        ];
        let mut made = 0;
        let map = SlotMap::from_ranges(&ranges, |r| {
            made += 1;
            name(r)
        });
        assert_eq!(made, 2, "one node per distinct primary");
        assert_eq!(map.nodes(), ["10.0.0.1:7000", "10.0.0.2:7000"]);
        assert_eq!(map.owner(0).map(String::as_str), Some("10.0.0.1:7000"));
        assert_eq!(map.owner(150).map(String::as_str), Some("10.0.0.2:7000"));
        assert_eq!(map.owner(16383).map(String::as_str), Some("10.0.0.1:7000"));
        assert_eq!(map.unowned(), 0);
        let partial = SlotMap::from_ranges(&[range(0, 9, "h", 1)], name);
        assert_eq!(partial.unowned(), SLOTS - 10);
        assert_eq!(partial.owner(10), None);
        assert_eq!(SlotMap::<String>::empty().owner(0), None);
    }

    #[test]
    fn moved_reassigns_one_slot_and_adds_a_new_node_once() {
        let map = SlotMap::from_ranges(&[range(0, 16383, "a", 1)], name);
        let same = |x: &String, y: &String| x == y;
        let moved = map.moved(42, &"b:1".to_owned(), same);
        assert_eq!(moved.owner(42).map(String::as_str), Some("b:1"));
        assert_eq!(moved.owner(41).map(String::as_str), Some("a:1"));
        let again = moved.moved(43, &"b:1".to_owned(), same);
        assert_eq!(again.nodes().len(), 2, "a known node is not added twice");
        assert_eq!(again.owner(43).map(String::as_str), Some("b:1"));
        assert!(!map.same_as(&moved, same));
        assert!(moved.same_as(&moved.moved(42, &"b:1".to_owned(), same), same));
        assert_eq!(
            map.owner(42).map(String::as_str),
            Some("a:1"),
            "the old map is untouched"
        );
    }

    #[test]
    fn redirect_addresses() {
        assert_eq!(parse_addr("127.0.0.1:7000"), Some(("127.0.0.1", 7000)));
        assert_eq!(parse_addr("[::1]:7000"), Some(("::1", 7000)));
        assert_eq!(parse_addr("nope"), None);
        assert_eq!(node_name("::1", 7000), "[::1]:7000");
    }
}
