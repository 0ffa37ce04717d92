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
# Starts an nginx with one worker answering `200 ok` to everything on a free port, its files in
# DIR; sets up_port and adds its PID to the caller's pids array.
upstream_200() {
  local dir=$1
  up_port=$(free_port)
  mkdir -p "$dir"
  cat >"$dir/nginx.conf" <<NGINX
worker_processes 1;
pid $dir/nginx.pid;
error_log $dir/error.log error;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  server { listen 127.0.0.1:$up_port; location / { return 200 'ok'; } }
}
NGINX
  nginx -c "$dir/nginx.conf" -g 'daemon off;' >"$dir/stdout.log" 2>&1 &
  pids+=($!)
  wait_port "$up_port"
}
