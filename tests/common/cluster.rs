//! A real Redis Cluster for tests: three primaries on free loopback ports, created with
//! `redis-cli --cluster create`, each redis-server stopped by its PID when dropped.

use std::process::{Command, Stdio};
use std::time::Duration;

use super::{free_ports, wait_until, Redis};

pub struct RedisCluster {
    pub nodes: Vec<Redis>,
    /// Each node's cluster bus port, chosen free like its own port: Redis's default, the port
    /// plus 10 000, could be a port another test has just been given for its gateway.
    bus_ports: Vec<u16>,
}

/// Settings every node starts with: a dead primary must not stop the others from serving
/// their own slots (`cluster-require-full-coverage no`).
fn node_args(dir: &std::path::Path, bus_port: u16) -> Vec<String> {
    let bus_port = bus_port.to_string();
    let nodes_conf = dir.join("nodes.conf").display().to_string();
    [
        "--cluster-enabled",
        "yes",
        "--cluster-port",
        &bus_port,
        "--cluster-node-timeout",
        "1000",
        "--cluster-require-full-coverage",
        "no",
        "--cluster-config-file",
        &nodes_conf,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

impl RedisCluster {
    /// Three primaries, no replicas.
    pub fn start() -> RedisCluster {
        Self::start_with_replicas(0)
    }

    /// Three primaries with `replicas` replicas each (`redis-cli` picks who replicates whom).
    pub fn start_with_replicas(replicas: usize) -> RedisCluster {
        let ports: Vec<[u16; 2]> = (0..3 * (1 + replicas)).map(|_| free_ports()).collect();
        let nodes: Vec<Redis> = ports
            .iter()
            .map(|&[port, bus]| Self::start_node(port, bus, None))
            .collect();
        let bus_ports = ports.iter().map(|&[_, bus]| bus).collect();
        let mut create = Command::new("redis-cli");
        create.args(["--cluster", "create"]);
        for n in &nodes {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli runs");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = RedisCluster { nodes, bus_ports };
        cluster.wait_ok();
        // A replica that has not finished its first sync never stands for election.
        wait_until(Duration::from_secs(30), "every replica in sync", || {
            let synced = cluster
                .nodes
                .iter()
                .filter(|n| {
                    let info: String = redis::cmd("INFO")
                        .arg("replication")
                        .query(&mut n.conn())
                        .unwrap_or_default();
                    info.contains("master_link_status:up")
                })
                .count();
            synced == 3 * replicas
        });
        cluster
    }

    /// A node on `port`; `conf_dir` keeps the node's identity across a restart.
    fn start_node(port: u16, bus_port: u16, conf_dir: Option<&std::path::Path>) -> Redis {
        let dir = tempfile::tempdir().expect("temp dir");
        let conf = conf_dir.unwrap_or(dir.path()).to_owned();
        let args = node_args(&conf, bus_port);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut redis = Redis::start_with(port, &args);
        redis.keep_dir(dir);
        redis
    }

    /// Waits until every live node says the cluster is ok and agrees on who owns each slot.
    pub fn wait_ok(&self) {
        wait_until(Duration::from_secs(30), "the cluster to be ok", || {
            self.nodes.iter().filter(|n| n.proc_alive()).all(|n| {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut n.conn())
                    .unwrap_or_default();
                info.contains("cluster_state:ok")
            })
        });
    }

    pub fn seed_urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect()
    }

    /// The index of the node that owns `key`, as the cluster says.
    pub fn owner(&self, key: &str) -> usize {
        let live = self
            .nodes
            .iter()
            .find(|n| n.proc_alive())
            .expect("a live node");
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut live.conn())
            .expect("KEYSLOT");
        self.owner_of_slot(slot)
    }

    pub fn owner_of_slot(&self, slot: u16) -> usize {
        let live = self
            .nodes
            .iter()
            .find(|n| n.proc_alive())
            .expect("a live node");
        let ranges: Vec<(u16, u16, (String, u16))> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query::<Vec<redis::Value>>(&mut live.conn())
            .expect("SLOTS")
            .into_iter()
            .map(|entry| {
                let redis::Value::Array(parts) = entry else {
                    panic!("CLUSTER SLOTS entry {entry:?}")
                };
                let int = |v: &redis::Value| match v {
                    redis::Value::Int(i) => *i as u16,
                    other => panic!("not an int: {other:?}"),
                };
                let redis::Value::Array(primary) = &parts[2] else {
                    panic!("primary {:?}", parts[2])
                };
                (
                    int(&parts[0]),
                    int(&parts[1]),
                    (String::new(), int(&primary[1])),
                )
            })
            .collect();
        let port = ranges
            .iter()
            .find(|(s, e, _)| (*s..=*e).contains(&slot))
            .map(|(_, _, (_, p))| *p)
            .expect("an owner");
        self.nodes
            .iter()
            .position(|n| n.port == port)
            .expect("a node of ours")
    }

    pub fn node_id(&self, i: usize) -> String {
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut self.nodes[i].conn())
            .expect("MYID")
    }

    /// `CLUSTER SETSLOT <slot> <args>` on node `node`.
    pub fn setslot(&self, node: usize, slot: u16, args: &[&str]) {
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg(args)
            .query(&mut self.nodes[node].conn())
            .expect("SETSLOT");
    }

    /// Starts moving `slot` from node `from` to node `to`, and moves `key` (of that slot)
    /// across: mid-migration, `from` answers `ASK` for it.
    pub fn migrate_key(&self, slot: u16, from: usize, to: usize, key: &str) {
        self.setslot(to, slot, &["IMPORTING", &self.node_id(from)]);
        self.setslot(from, slot, &["MIGRATING", &self.node_id(to)]);
        let _: () = redis::cmd("MIGRATE")
            .arg("127.0.0.1")
            .arg(self.nodes[to].port)
            .arg("")
            .arg(0)
            .arg(5000)
            .arg("KEYS")
            .arg(key)
            .query(&mut self.nodes[from].conn())
            .expect("MIGRATE");
    }

    /// Starts one more primary, without slots, and has the cluster meet it: a node outside
    /// the slot map until slots move to it. Its index.
    pub fn add_empty_node(&mut self) -> usize {
        let [port, bus] = free_ports();
        let node = Self::start_node(port, bus, None);
        let _: () = redis::cmd("CLUSTER")
            .arg("MEET")
            .arg("127.0.0.1")
            .arg(port)
            .arg(bus)
            .query(&mut self.nodes[0].conn())
            .expect("MEET");
        self.nodes.push(node);
        self.bus_ports.push(bus);
        let count = self.nodes.len();
        wait_until(
            Duration::from_secs(30),
            "every node to know the new one",
            || {
                self.nodes.iter().all(|n| {
                    let nodes: String = redis::cmd("CLUSTER")
                        .arg("NODES")
                        .query(&mut n.conn())
                        .unwrap_or_default();
                    nodes
                        .lines()
                        .filter(|l| l.contains("master") && !l.contains("handshake"))
                        .count()
                        == count
                })
            },
        );
        self.wait_ok();
        count - 1
    }

    /// Kills node `i` (SIGKILL) and waits for it to exit.
    pub fn kill(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        node.proc.signal("KILL");
        node.proc
            .wait_exit(Duration::from_secs(5))
            .expect("the node died");
    }

    /// Starts node `i` again on its port with its saved identity, so it takes its slots back.
    pub fn restart(&mut self, i: usize) {
        let port = self.nodes[i].port;
        let dir = self.nodes[i].take_dir().expect("the node's directory");
        let mut node = Self::start_node(port, self.bus_ports[i], Some(dir.path()));
        node.keep_dir(dir);
        self.nodes[i] = node;
        self.wait_ok();
    }
}
