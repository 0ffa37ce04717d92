# Helpers shared by the bash benches (sourced, never run): free loopback ports, waiting for a
# listener, and CPU time of a process from /proc.

# A free TCP port on 127.0.0.1.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# Waits up to 10 s for something to listen on 127.0.0.1:PORT; exits the bench if nothing does.
wait_port() { for _ in $(seq 1 200); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }
# CPU ticks (utime + stime) of a process, every thread included, by PID; hz ticks a second.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# The same summed over several PIDs.
ticks_all() { local t=0; for p in "$@"; do t=$((t + $(ticks "$p"))); done; echo "$t"; }
hz=$(getconf CLK_TCK)
