# Functions of the test cluster, sourced by tests/cluster/*.sh (bash). See bring_up.sh.
STATE=/run/hpcpar-cluster          # pid files, hosts file, SLURM's configuration, state and logs
LOCK=/run/hpcpar-cluster.lock      # one bring-up or tear-down at a time
SWITCH=hpcpar-switch               # the network namespace that holds the bridge
PREFIX=10.77.0                     # node i is $PREFIX.i/24; this subnet exists only in the namespaces

die() { echo "$(basename "$0"): $*" >&2; exit 1; }
log() { echo "$(basename "$0"): $*" >&2; }

node_names() { [ -s "$STATE/nodes" ] && seq -f 'node%g' 1 "$(cat "$STATE/nodes")"; }
netns_of() { echo "hpcpar-$1"; }   # node1 -> the network namespace hpcpar-node1 (`ip netns` lists it)

# The process that holds NODE's namespaces, when it is alive and its network namespace is still
# the one `ip netns` names for NODE (so a recycled pid never passes).
node_pid() {
    local pid
    pid=$(cat "$STATE/$1.pid" 2>/dev/null) && [ -n "$pid" ] || return 1
    [ -e "/proc/$pid/ns/net" ] && [ -e "/run/netns/$(netns_of "$1")" ] || return 1
    [ "$(stat -L -c %i "/proc/$pid/ns/net")" = "$(stat -L -c %i "/run/netns/$(netns_of "$1")")" ] || return 1
    echo "$pid"
}

cluster_is_up() {
    local node
    [ -s "$STATE/nodes" ] && [ -e "/run/netns/$SWITCH" ] || return 1
    for node in $(node_names); do node_pid "$node" >/dev/null || return 1; done
}

cluster_is_down() {
    [ ! -e "$STATE" ] && [ ! -e "/run/netns/$SWITCH" ] && ! ip netns list | grep -q '^hpcpar-node'
}

# Bits per second of a tc rate (10gbit, 800mbit, 5000kbit, 1000000bit); fails on anything else.
rate_bits() {
    [[ "$1" =~ ^([0-9]+)(bit|kbit|mbit|gbit)$ ]] || return 1
    local scale
    case "${BASH_REMATCH[2]}" in bit) scale=1 ;; kbit) scale=1000 ;; mbit) scale=1000000 ;; gbit) scale=1000000000 ;; esac
    echo $((BASH_REMATCH[1] * scale))
}

# Start the process that holds a node's namespaces: it names the node, mounts a /dev/shm and an
# /etc/hosts of its own and a /sys that shows the node's network devices (/sys/class/net; the
# control groups of /sys/fs/cgroup stay, slurmd wants them), then sleeps until tear_down.sh ends
# it. System V IPC is the node's own too.
start_node_process() { # NODE
    local node=$1 pid
    mkdir -p "$STATE/$node.cgroup"
    setsid unshare --net --uts --ipc --mount --propagation slave -- /bin/sh -c '
        set -e
        hostname "$1"
        mount -t tmpfs -o mode=1777 "shm-$1" /dev/shm
        mount --bind "$2" /etc/hosts
        if mountpoint -q /sys/fs/cgroup; then mount --rbind /sys/fs/cgroup "$3"; fi
        umount -l /sys
        mount -t sysfs "sys-$1" /sys
        if mountpoint -q "$3"; then mount --move "$3" /sys/fs/cgroup; fi
        rmdir "$3"
        exec sleep infinity' \
        sh "$node" "$STATE/hosts" "$STATE/$node.cgroup" </dev/null >>"$STATE/$node.log" 2>&1 8>&- &
    pid=$!
    for _ in $(seq 100); do
        [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = sleep ] && break
        kill -0 "$pid" 2>/dev/null || die "could not make the namespaces of $node: $(tail -n 1 "$STATE/$node.log")"
        sleep 0.05
    done
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = sleep ] || die "$node's namespaces were not ready after 5 s"
    echo "$pid" >"$STATE/$node.pid"
}

make_cluster() { # N
    local n=$1 i node ns
    mkdir -p "$STATE"
    { cat /etc/hosts; echo "# the hpcpar test cluster (tests/cluster/bring_up.sh)"
      for i in $(seq "$n"); do echo "$PREFIX.$i node$i"; done; } >"$STATE/hosts"
    ip netns add "$SWITCH" || die "ip netns add failed: network namespaces are not permitted here"
    ip -n "$SWITCH" link add br0 type bridge
    ip -n "$SWITCH" link set br0 up
    for i in $(seq "$n"); do
        node=node$i ns=$(netns_of node$i)
        start_node_process "$node"
        ip netns attach "$ns" "$(cat "$STATE/$node.pid")"
        ip link add eth0 netns "$ns" type veth peer name "$node" netns "$SWITCH"
        ip -n "$SWITCH" link set "$node" master br0 up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "$PREFIX.$i/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
    echo "$n" >"$STATE/nodes"
    # Every node reaches every other before anyone uses the cluster (an ARP round per pair).
    for i in $(seq "$n"); do
        for j in $(seq "$n"); do
            [ "$i" = "$j" ] || wait_reachable "node$i" "$PREFIX.$j"
        done
    done
}

wait_reachable() { # NODE ADDRESS: a TCP connect from NODE to ADDRESS:1 is refused (not unreachable)
    local out
    for _ in $(seq 50); do
        out=$(ip netns exec "$(netns_of "$1")" bash -c "exec 3<>/dev/tcp/$2/1" 2>&1) || true
        case "$out" in *refused*) return 0 ;; esac
        sleep 0.1
    done
    die "$1 cannot reach $2: $out"
}

# Kill every process inside the nodes (ranks, SLURM daemons, the holders), then remove the
# namespaces, the links (they vanish with their namespaces) and the state directory.
remove_cluster() {
    local ns pids
    for ns in $(ip netns list | awk '/^hpcpar-node[0-9]+( |$)/ {print $1}'); do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [ -z "$pids" ] || kill $pids 2>/dev/null || true
    done
    for _ in $(seq 100); do
        pids=$(for ns in $(ip netns list | awk '/^hpcpar-node[0-9]+( |$)/ {print $1}'); do ip netns pids "$ns"; done 2>/dev/null)
        [ -z "$pids" ] && break
        sleep 0.1
    done
    [ -z "$pids" ] || { log "killing what ignored SIGTERM for 10 s: $pids"; kill -KILL $pids 2>/dev/null || true; }
    for ns in $(ip netns list | awk '/^hpcpar-(node[0-9]+|switch)( |$)/ {print $1}'); do ip netns del "$ns"; done
    rm -rf "$STATE"
}

# Limit each node's outgoing link (tbf), or add netem's delay (and rate); no arguments: unshaped.
shape_links() { # RATE DELAY
    local rate=$1 delay=$2 node ns burst err
    for node in $(node_names); do
        ns=$(netns_of "$node")
        if [ -n "$delay" ]; then
            err=$(tc -n "$ns" qdisc replace dev eth0 root netem delay "$delay" ${rate:+rate "$rate"} 2>&1) ||
                die "--delay needs the netem qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM): $err; --rate alone works (tbf)"
        elif [ -n "$rate" ]; then
            # A bucket of 1 ms at the rate (at least 128 KiB, so a 64 KiB GSO packet always fits).
            burst=$(($(rate_bits "$rate") / 8000)); [ "$burst" -ge 131072 ] || burst=131072
            err=$(tc -n "$ns" qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms 2>&1) ||
                die "tc tbf on $node failed: $err"
        else
            tc -n "$ns" qdisc del dev eth0 root 2>/dev/null || true
        fi
    done
    printf '%s\n' "rate=${rate:-none}" "delay=${delay:-none}" >"$STATE/shaping"
}
