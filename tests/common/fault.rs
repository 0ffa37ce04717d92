//! A TCP fault proxy in front of Redis: pass, refuse, black-hole, stall, cut.
//!
//! Black-hole and stall apply to live connections too, as a hung or slow Redis would.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pass,
    /// Nothing listens: connections are refused.
    Refuse,
    /// Connections are accepted and read, but nothing reaches Redis and nothing comes back.
    Blackhole,
    /// Every reply from Redis is held back this long.
    Stall(Duration),
    /// Every reply from Redis arrives this long after Redis sent it, the replies in flight
    /// together each delayed once (a Redis far away), where `Stall` queues them one after
    /// another.
    Delay(Duration),
    /// Connections pass until the client sends this text (any case); from that write on,
    /// nothing more reaches Redis: a Redis that hangs in the middle of a conversation.
    SwallowFrom(&'static str),
}

struct State {
    mode: Mutex<Mode>,
    conns: Mutex<Vec<TcpStream>>,
    /// Reads from clients, in any mode: what the gateway tried to send to Redis.
    client_writes: AtomicU64,
    /// EVALSHA commands sent by clients, in any mode.
    evalsha: AtomicU64,
    accepted: AtomicU64,
    stop: AtomicBool,
    /// Connections accepted before this generation stay silent whatever the mode.
    silent_before: AtomicU64,
    /// Replies on connections accepted before this generation are held back this long (the
    /// mode applies to the others).
    delayed_before: Mutex<(u64, Duration)>,
    /// What clients send on connections accepted from this generation on reaches Redis this
    /// long after they sent it.
    slow_from: Mutex<(u64, Duration)>,
    generation: AtomicU64,
}

pub struct FaultProxy {
    pub port: u16,
    state: Arc<State>,
    acceptor: Option<thread::JoinHandle<()>>,
}

impl FaultProxy {
    pub fn start(redis_port: u16) -> FaultProxy {
        let port = super::free_port();
        let state = Arc::new(State {
            mode: Mutex::new(Mode::Pass),
            conns: Mutex::new(Vec::new()),
            client_writes: AtomicU64::new(0),
            evalsha: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            silent_before: AtomicU64::new(0),
            delayed_before: Mutex::new((0, Duration::ZERO)),
            slow_from: Mutex::new((u64::MAX, Duration::ZERO)),
            generation: AtomicU64::new(0),
        });
        let st = Arc::clone(&state);
        let acceptor = thread::spawn(move || accept_loop(port, redis_port, st));
        super::wait_until(Duration::from_secs(5), "the fault proxy to listen", || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        FaultProxy {
            port,
            state,
            acceptor: Some(acceptor),
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Switches mode. Live connections are cut when leaving Blackhole or SwallowFrom (their
    /// swallowed commands would otherwise leave replies out of step); `cut` does it on demand.
    pub fn set(&self, mode: Mode) {
        let prev = std::mem::replace(&mut *self.state.mode.lock().unwrap(), mode);
        if matches!(prev, Mode::Blackhole | Mode::SwallowFrom(_)) {
            self.cut();
        }
    }

    /// Redis answers again on new connections, while the live ones stay silent and open: a
    /// peer that vanished without a reset (a host gone, a failover to another address).
    pub fn pass_new_only(&self) {
        let next = self.state.generation.fetch_add(1, Ordering::SeqCst) + 1;
        self.state.silent_before.store(next, Ordering::SeqCst);
        *self.state.mode.lock().unwrap() = Mode::Pass;
    }

    /// Replies on the live connections are held back `delay` (zero: no longer), while new
    /// connections follow the mode: a slow answer on a socket about to be replaced.
    pub fn delay_live(&self, delay: Duration) {
        let next = self.state.generation.fetch_add(1, Ordering::SeqCst) + 1;
        *self.state.delayed_before.lock().unwrap() = (next, delay);
    }

    /// What clients send on connections made from now on reaches Redis `delay` late, while
    /// the live connections pass as before: a new connection to a node far away.
    pub fn slow_new(&self, delay: Duration) {
        let next = self.state.generation.fetch_add(1, Ordering::SeqCst) + 1;
        *self.state.slow_from.lock().unwrap() = (next, delay);
    }

    /// Redis goes away: new connections are refused and live ones are cut.
    pub fn refuse_and_cut(&self) {
        self.set(Mode::Refuse);
        self.cut();
    }

    /// Closes every live connection, in both directions.
    pub fn cut(&self) {
        for c in self.state.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    pub fn client_writes(&self) -> u64 {
        self.state.client_writes.load(Ordering::SeqCst)
    }

    /// EVALSHA commands that reached the proxy (forwarded or not).
    pub fn evalsha_sent(&self) -> u64 {
        self.state.evalsha.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.state.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        self.cut();
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
    }
}

fn accept_loop(port: u16, redis_port: u16, st: Arc<State>) {
    let mut listener: Option<TcpListener> = None;
    while !st.stop.load(Ordering::SeqCst) {
        let mode = *st.mode.lock().unwrap();
        if mode == Mode::Refuse {
            listener = None;
            thread::sleep(Duration::from_millis(2));
            continue;
        }
        if listener.is_none() {
            match TcpListener::bind(("127.0.0.1", port)) {
                Ok(l) => {
                    l.set_nonblocking(true).expect("nonblocking");
                    listener = Some(l);
                }
                Err(_) => {
                    thread::sleep(Duration::from_millis(5));
                    continue;
                }
            }
        }
        match listener.as_ref().expect("bound").accept() {
            Ok((client, _)) => {
                client.set_nonblocking(false).expect("blocking");
                // As the gateway and every proxy made for Redis do: a command split over two
                // reads (a script load of more than a read's 16 KiB) must not wait for an ACK.
                client.set_nodelay(true).expect("nodelay");
                handle(client, redis_port, &st);
            }
            Err(_) => thread::sleep(Duration::from_millis(2)),
        }
    }
}

fn handle(client: TcpStream, redis_port: u16, st: &Arc<State>) {
    let mode = *st.mode.lock().unwrap();
    let born = st.generation.load(Ordering::SeqCst);
    st.accepted.fetch_add(1, Ordering::SeqCst);
    let server = match mode {
        Mode::Blackhole => None,
        _ => match TcpStream::connect(("127.0.0.1", redis_port)) {
            Ok(s) => {
                s.set_nodelay(true).expect("nodelay");
                Some(s)
            }
            Err(_) => {
                let _ = client.shutdown(Shutdown::Both);
                return;
            }
        },
    };
    {
        let mut conns = st.conns.lock().unwrap();
        conns.push(client.try_clone().expect("clone"));
        if let Some(s) = &server {
            conns.push(s.try_clone().expect("clone"));
        }
    }
    let up_state = Arc::clone(st);
    let mut from_client = client.try_clone().expect("clone");
    let mut to_server = server.as_ref().map(|s| s.try_clone().expect("clone"));
    thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        let mut swallowing = false;
        loop {
            let n = match from_client.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            up_state.client_writes.fetch_add(1, Ordering::SeqCst);
            let evalshas = buf[..n]
                .windows(7)
                .filter(|w| w.eq_ignore_ascii_case(b"EVALSHA"))
                .count();
            up_state
                .evalsha
                .fetch_add(evalshas as u64, Ordering::SeqCst);
            let mode = *up_state.mode.lock().unwrap();
            if let Mode::SwallowFrom(marker) = mode {
                swallowing |= buf[..n]
                    .windows(marker.len())
                    .any(|w| w.eq_ignore_ascii_case(marker.as_bytes()));
            }
            if swallowing
                || mode == Mode::Blackhole
                || born < up_state.silent_before.load(Ordering::SeqCst)
            {
                continue;
            }
            let (from, slow) = *up_state.slow_from.lock().unwrap();
            if born >= from {
                thread::sleep(slow);
            }
            if let Some(s) = to_server.as_mut() {
                if s.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
        if let Some(s) = to_server {
            let _ = s.shutdown(Shutdown::Both);
        }
    });
    let Some(mut from_server) = server else {
        return;
    };
    let down_state = Arc::clone(st);
    let mut to_client = client;
    // Replies pass through a line that releases each when it is due.
    let (line, due) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    thread::spawn(move || {
        while let Ok((at, bytes)) = due.recv() {
            thread::sleep(at.saturating_duration_since(Instant::now()));
            if to_client.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = to_client.shutdown(Shutdown::Both);
    });
    thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            let n = match from_server.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mode = *down_state.mode.lock().unwrap();
            if born < down_state.silent_before.load(Ordering::SeqCst) {
                continue;
            }
            let (old, delay) = *down_state.delayed_before.lock().unwrap();
            if born < old && !delay.is_zero() {
                if line
                    .send((Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
                {
                    break;
                }
                continue;
            }
            let at = match mode {
                Mode::Blackhole => continue,
                Mode::Stall(d) => {
                    thread::sleep(d);
                    Instant::now()
                }
                Mode::Delay(d) => Instant::now() + d,
                _ => Instant::now(),
            };
            if line.send((at, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    });
}
