//! A TCP fault proxy in front of Redis: pass, refuse, black-hole, stall, cut.
//!
//! Black-hole and stall apply to live connections too, as a hung or slow Redis would.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pass,
    /// Nothing listens: connections are refused.
    Refuse,
    /// Connections are accepted and read, but nothing reaches Redis and nothing comes back.
    Blackhole,
    /// Every reply from Redis is held back this long.
    Stall(Duration),
}

struct State {
    mode: Mutex<Mode>,
    conns: Mutex<Vec<TcpStream>>,
    /// Reads from clients, in any mode: what the gateway tried to send to Redis.
    client_writes: AtomicU64,
    stop: AtomicBool,
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
            stop: AtomicBool::new(false),
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

    /// Switches mode. Live connections are cut when leaving Blackhole (its swallowed
    /// commands would otherwise leave replies out of step); `cut` does it on demand.
    pub fn set(&self, mode: Mode) {
        let prev = std::mem::replace(&mut *self.state.mode.lock().unwrap(), mode);
        if prev == Mode::Blackhole {
            self.cut();
        }
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
                handle(client, redis_port, &st);
            }
            Err(_) => thread::sleep(Duration::from_millis(2)),
        }
    }
}

fn handle(client: TcpStream, redis_port: u16, st: &Arc<State>) {
    let mode = *st.mode.lock().unwrap();
    let server = match mode {
        Mode::Blackhole => None,
        _ => match TcpStream::connect(("127.0.0.1", redis_port)) {
            Ok(s) => Some(s),
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
        loop {
            let n = match from_client.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            up_state.client_writes.fetch_add(1, Ordering::SeqCst);
            let mode = *up_state.mode.lock().unwrap();
            if mode == Mode::Blackhole {
                continue;
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
    thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            let n = match from_server.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mode = *down_state.mode.lock().unwrap();
            match mode {
                Mode::Blackhole => continue,
                Mode::Stall(d) => thread::sleep(d),
                _ => {}
            }
            if to_client.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to_client.shutdown(Shutdown::Both);
    });
}
