#!/usr/bin/env bash
# Per-node caches against one cluster, same total capacity, same requests (issue 13 item 7).
#
#   scripts/bench-cluster.sh [--nodes N] [--trace PATH] [--total-tokens T] [--route R]
#                            [--out DIR] [--cluster-set KEY=VALUE ...] [--lookup-blocks B]
#                            [--kill N[,N...]:AT:DOWN | --kill-etcd AT:DOWN] [--window-s W]
#                            [--nvme BYTES]
#                            [-- extra kvtier-bench replay (or lookup) flags]
#
# Starts an etcd on loopback, then twice N kvtier-servers (release build, feature `cluster`)
# on loopback TCP, each with a DRAM tier of T/N tokens of the replay's `tiny` model:
#   islands  - N servers that know nothing of each other (what a fleet has without kvtier's
#              cluster: each node's own cache);
#   cluster  - the same N servers as members of one cluster on the etcd.
# and replays the trace against each fleet with `kvtier-bench replay --server ... --route R`
# (every request served whole by one node). Prints both hit rates and their ratio, and leaves
# the two JSON reports and the servers' logs in DIR. Every process it starts, it stops.
# --cluster-set passes a setting to the cluster's members only (e.g. cluster.guests_first=false).
# --lookup-blocks B: no replay; on the cluster fleet only, `kvtier-bench lookup --server ...`
# times lookups of B-block chains put on one member, from the others (docs/benchmarks.md).
# --kill N:AT:DOWN: a node killed mid-replay. No islands; the cluster fleet twice, each from
# a fresh start, with the same requests: `control` untouched, and `killed`, where member N
# (1..nodes) gets SIGKILL AT seconds after its replay began and is started again (empty:
# no NVMe here) DOWN seconds later. `N1,N2:AT:DOWN` kills several members at once. Both replays run with --failover (a request its member
# fails goes to the next, as a router would) and --window-s W (default 2); prints the hit
# rate of each window of both runs, of the spans before the kill, while the node is down,
# the first 10 s after its restart and the rest, the dip, the first window from the restart
# on within 5 points of the control's, and the wrong bytes (corrupt blocks; must be 0).
# Make AT and DOWN multiples of W, so no window straddles the kill or the restart.
# --kill-etcd AT:DOWN: the same, with etcd killed (SIGKILL) instead of a member and started
# again on its data DOWN seconds later (members keep their last view meanwhile).
# --nvme BYTES: every server also has an NVMe tier of BYTES (in its run directory, which a
# killed member finds again: it restarts warm).
#
# Defaults: 3 nodes, the Claude Code samples, 1m tokens in all, round robin.
set -euo pipefail
cd "$(dirname "$0")/.."

nodes=3
trace=../shared/traces/claude-code-sample
total=1m
route=round-robin
out=""
extra=()
cluster_sets=()
lookup_blocks=""
kill_spec=""
kill_etcd_spec=""
nvme_bytes=""
window_s=2
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) nodes=$2; shift 2 ;;
        --trace) trace=$2; shift 2 ;;
        --total-tokens) total=$2; shift 2 ;;
        --route) route=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --cluster-set) cluster_sets+=(--set "$2"); shift 2 ;;
        --lookup-blocks) lookup_blocks=$2; shift 2 ;;
        --kill) kill_spec=$2; shift 2 ;;
        --kill-etcd) kill_etcd_spec=$2; shift 2 ;;
        --nvme) nvme_bytes=$2; shift 2 ;;
        --window-s) window_s=$2; shift 2 ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
        *) echo "bench-cluster: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$nodes" in ''|*[!0-9]*) echo "bench-cluster: --nodes must be a number" >&2; exit 2 ;; esac
if [ "$nodes" -lt 1 ] || [ "$nodes" -gt 16 ]; then
    echo "bench-cluster: --nodes must be 1..16" >&2; exit 2
fi
[ -e "$trace" ] || { echo "bench-cluster: no trace at $trace" >&2; exit 2; }
case "$nvme_bytes" in *[!0-9]*) echo "bench-cluster: --nvme wants a byte count" >&2; exit 2 ;; esac
if [ -n "$kill_etcd_spec" ]; then
    [ -z "$kill_spec" ] || { echo "bench-cluster: --kill and --kill-etcd exclude each other" >&2; exit 2; }
    IFS=: read -r kill_at kill_down <<< "$kill_etcd_spec"
    for v in "$kill_at" "$kill_down"; do
        case "$v" in ''|*[!0-9]*)
            echo "bench-cluster: --kill-etcd wants AT:DOWN, whole numbers of seconds" >&2
            exit 2 ;;
        esac
    done
    [ -z "$lookup_blocks" ] || { echo "bench-cluster: --kill-etcd and --lookup-blocks exclude each other" >&2; exit 2; }
    kill_node=etcd
    kill_spec="etcd:$kill_etcd_spec"
elif [ -n "$kill_spec" ]; then
    IFS=: read -r kill_node kill_at kill_down <<< "$kill_spec"
    IFS=, read -r -a kill_nodes <<< "$kill_node"
    for v in "${kill_nodes[@]}" "$kill_at" "$kill_down"; do
        case "$v" in ''|*[!0-9]*)
            echo "bench-cluster: --kill wants N[,N...]:AT:DOWN, whole numbers (nodes, seconds, seconds)" >&2
            exit 2 ;;
        esac
    done
    for n in "${kill_nodes[@]}"; do
        if [ "$n" -lt 1 ] || [ "$n" -gt "$nodes" ]; then
            echo "bench-cluster: --kill: node $n is not one of 1..$nodes" >&2; exit 2
        fi
    done
    if [ "${#kill_nodes[@]}" -ge "$nodes" ]; then
        echo "bench-cluster: --kill: at least one node must stay up" >&2; exit 2
    fi
    [ -z "$lookup_blocks" ] || { echo "bench-cluster: --kill and --lookup-blocks exclude each other" >&2; exit 2; }
fi
etcd_bin=${ETCD_BIN:-$(command -v etcd || true)}
[ -n "$etcd_bin" ] || { echo "bench-cluster: no etcd (install it with .ci/install-deps)" >&2; exit 2; }

tokens() { # 1m -> 1000000, 300k -> 300000
    local v=${1,,}
    case "$v" in
        *k) echo $(( ${v%k} * 1000 )) ;;
        *m) echo $(( ${v%m} * 1000000 )) ;;
        *[!0-9]*|'') echo "bench-cluster: --total-tokens $1 is not a count" >&2; exit 2 ;;
        *) echo "$v" ;;
    esac
}
total_tokens=$(tokens "$total")
case "$trace" in
    *.jsonl) block_tokens=512 ;;
    *) block_tokens=64 ;;
esac
# The replay's `tiny` model: 16 bytes a token; slots are whole 4 KiB pages.
block_bytes=$(( block_tokens * 16 ))
slot=$(( (block_bytes + 4095) / 4096 * 4096 ))
node_blocks=$(( total_tokens / block_tokens / nodes ))
[ "$node_blocks" -ge 1 ] || { echo "bench-cluster: --total-tokens is under a block a node" >&2; exit 2; }

# BIN_DIR: binaries built elsewhere (kvtier-server with the `cluster` feature); default: build
# the release ones here.
if [ -z "${BIN_DIR:-}" ]; then
    cargo build --release -q -p kvtier-server --features cluster -p kvtier-bench
    BIN_DIR=target/release
fi
server=$BIN_DIR/kvtier-server
bench=$BIN_DIR/kvtier-bench

work=$(mktemp -d /tmp/kvtier-bench-cluster.XXXXXX)
out=${out:-$(mktemp -d /tmp/kvtier-bench-cluster-out.XXXXXX)}
mkdir -p "$out"
pids=()
stop_all() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    pids=()
}
trap 'stop_all; rm -rf "$work"' EXIT

port_base=$(( 20000 + ($$ % 2000) * 20 ))
etcd_port=$(( port_base + 19 ))
token=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
head -c 32 /dev/urandom | base64 > "$work/secret"
chmod 600 "$work/secret"

declare -A node_pid
start_node() { # $1: islands | cluster, $2: the run's name (logs), $3: the node
    local mode=$1 name=$2 n=$3
    local tcp=$(( port_base + n * 2 )) admin=$(( port_base + n * 2 + 1 ))
    local run="$work/$name-n$n"
    mkdir -p "$run" && chmod 700 "$run"
    local sets=(
        --set "server.runtime_dir=\"$run\"" --set 'server.unix="off"'
        --set "server.tcp=\"127.0.0.1:$tcp\"" --set 'server.quic="off"'
        --set 'server.tls="off"' --set "server.admin=\"127.0.0.1:$admin\""
        --set "server.token=\"$token\""
        --set "store.dram_bytes=$(( node_blocks * slot ))"
        --set 'store.dram_prefault=false'
        --set layout.layers=1 --set layout.kv_heads=1 --set layout.head_dim=4
        --set 'layout.dtype="bf16"' --set "layout.block_tokens=$block_tokens"
    )
    if [ -n "$nvme_bytes" ]; then
        sets+=(--set "store.nvme_dir=\"$run/nvme\"" --set "store.nvme_bytes=$nvme_bytes")
    else
        sets+=(--set 'store.nvme_dir=""')
    fi
    if [ "$mode" = cluster ]; then
        sets+=(
            --set "cluster.etcd_endpoints=\"http://127.0.0.1:$etcd_port\""
            --set "cluster.node_id=\"n$n\"" --set "cluster.secret_file=\"$work/secret\""
            --set "cluster.lease_ttl_s=5"
            "${cluster_sets[@]}"
        )
    fi
    "$server" "${sets[@]}" >> "$out/$name-n$n.log" 2>&1 &
    pids+=($!)
    node_pid[$n]=$!
}

start_fleet() { # $1: islands | cluster, $2: the run's name (default: $1)
    local mode=$1 name=${2:-$1} n urls=()
    for n in $(seq 1 "$nodes"); do
        start_node "$mode" "$name" "$n"
        urls+=(--server "tcp://127.0.0.1:$(( port_base + n * 2 ))")
    done
    # Ready: every admin port answers /health (and, in a cluster, sees every member).
    local deadline=$(( SECONDS + 30 ))
    for n in $(seq 1 "$nodes"); do
        local admin=$(( port_base + n * 2 + 1 ))
        until curl -sf "http://127.0.0.1:$admin/health" > /dev/null 2>&1 &&
            { [ "$mode" = islands ] ||
              [ "$(curl -sf "http://127.0.0.1:$admin/cluster" |
                   python3 -c 'import json,sys; print(len(json.load(sys.stdin)["members"]))')" = "$nodes" ]; }; do
            if [ $SECONDS -ge $deadline ]; then
                echo "bench-cluster: node $n of the $mode fleet not ready in 30 s; its log:" >&2
                tail -20 "$out/$name-n$n.log" >&2
                exit 1
            fi
            sleep 0.2
        done
    done
    fleet_urls=("${urls[@]}")
}

start_etcd() { # on its data directory, which a restart finds again
    "$etcd_bin" --name bench --data-dir "$work/etcd" \
        --listen-client-urls "http://127.0.0.1:$etcd_port" \
        --advertise-client-urls "http://127.0.0.1:$etcd_port" \
        --listen-peer-urls "http://127.0.0.1:$(( etcd_port - 1 ))" \
        --initial-advertise-peer-urls "http://127.0.0.1:$(( etcd_port - 1 ))" \
        --initial-cluster "bench=http://127.0.0.1:$(( etcd_port - 1 ))" \
        >> "$out/etcd.log" 2>&1 &
    pids+=($!)
    etcd_pid=$!
}
start_etcd

runs="islands cluster"
if [ -n "$lookup_blocks" ]; then
    case "$lookup_blocks" in *[!0-9]*) echo "bench-cluster: --lookup-blocks must be a number" >&2; exit 2 ;; esac
    runs=cluster
fi
[ -z "$kill_spec" ] || runs="control killed"
for name in $runs; do
    mode=$name
    [ -z "$kill_spec" ] || mode=cluster
    start_fleet "$mode" "$name"
    if [ -n "$lookup_blocks" ]; then
        echo "== lookups: $nodes members x $node_blocks blocks, chains of $lookup_blocks" >&2
        "$bench" lookup "${fleet_urls[@]}" --token "$token" --blocks "$lookup_blocks" \
            "${extra[@]}" | tee "$out/lookup.txt"
        continue
    fi
    echo "== $name: $nodes nodes x $node_blocks blocks ($block_tokens tokens), route $route" >&2
    fault=()
    [ -z "$kill_spec" ] || fault=(--failover --window-s "$window_s")
    "$bench" --json replay --trace "$trace" "${fleet_urls[@]}" --route "$route" \
        --token "$token" --model tiny "${fault[@]}" "${extra[@]}" > "$out/$name.json" &
    replay_pid=$!
    if [ "$name" = killed ] && [ "$kill_node" = etcd ]; then
        sleep "$kill_at"
        kill -9 "$etcd_pid"
        wait "$etcd_pid" 2>/dev/null || true
        echo "== killed etcd at $kill_at s; starting it again in $kill_down s" >&2
        sleep "$kill_down"
        start_etcd
        echo "$kill_at $kill_down" > "$out/kill.txt"
    elif [ "$name" = killed ]; then
        sleep "$kill_at"
        for n in "${kill_nodes[@]}"; do kill -9 "${node_pid[$n]}"; done
        for n in "${kill_nodes[@]}"; do wait "${node_pid[$n]}" 2>/dev/null || true; done
        echo "== killed node(s) $kill_node at $kill_at s; starting again in $kill_down s" >&2
        sleep "$kill_down"
        for n in "${kill_nodes[@]}"; do start_node cluster "$name" "$n"; done
        echo "$kill_at $kill_down" > "$out/kill.txt"
    fi
    wait "$replay_pid" || { echo "bench-cluster: the $name replay failed" >&2; exit 1; }
    # What each server says of the run (offers, remote hits, peer traffic), then stop this
    # fleet's servers (not etcd) before the next one starts.
    for n in $(seq 1 "$nodes"); do
        admin=$(( port_base + n * 2 + 1 ))
        curl -sf "http://127.0.0.1:$admin/cluster" > "$out/$name-n$n.cluster.json" || true
        curl -sf "http://127.0.0.1:$admin/metrics" > "$out/$name-n$n.metrics" || true
    done
    for p in "${pids[@]}"; do
        [ "$p" = "$etcd_pid" ] || { kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; }
    done
    pids=("$etcd_pid")
done
[ -z "$lookup_blocks" ] || exit 0

if [ -n "$kill_spec" ]; then
    python3 - "$out" "$kill_node" "${nvme_bytes:+warm from its NVMe}" <<'EOF'
import json, sys
out, node, restart = sys.argv[1], sys.argv[2], sys.argv[3] or "empty"
r = {m: json.load(open(f"{out}/{m}.json"))["result"] for m in ("control", "killed")}
at, down = (float(x) for x in open(f"{out}/kill.txt").read().split())
wc, wk = r["control"]["windows"], r["killed"]["windows"]
what = "etcd" if node == "etcd" else (f"nodes {node}" if "," in node else f"node {node}")
restart = "on its data" if node == "etcd" else restart
print(f"{what} killed at {at:.0f} s, started again at {at + down:.0f} s ({restart})")
print(f"{'from s':>7} {'control %':>10} {'killed %':>9} {'diff':>7} {'rerouted':>9} {'corrupt':>8}")
diffs = []
for i, k in enumerate(wk):
    c = wc[i] if i < len(wc) else None
    d = (k["hit_rate"] - c["hit_rate"]) * 100 if c and c["requests"] and k["requests"] else None
    diffs.append((k["start_s"], d))
    ch = f"{c['hit_rate'] * 100:10.2f}" if c else f"{'-':>10}"
    ds = f"{d:+7.2f}" if d is not None else f"{'-':>7}"
    print(f"{k['start_s']:7.1f} {ch} {k['hit_rate'] * 100:9.2f} {ds} "
          f"{k['rerouted']:9d} {k['corrupt_blocks']:8d}")
def span(w, lo, hi):
    xs = [x for x in w if lo <= x["start_s"] < hi]
    blocks = sum(x["blocks"] for x in xs)
    return sum(x["hit_blocks"] for x in xs) / blocks * 100 if blocks else float("nan")
end = max(x["start_s"] for x in wk) + 1
print("hit rate over spans (blocks of the requests that began in them):")
for label, lo, hi in (("before the kill", 0, at), (f"{what} down", at, at + down),
                      ("first 10 s after the restart", at + down, at + down + 10),
                      ("the rest", at + down + 10, end)):
    print(f"  {label:30s} control {span(wc, lo, hi):6.2f} %  killed {span(wk, lo, hi):6.2f} %")
before = [abs(d) for s, d in diffs if s + 1e-9 < at and d is not None]
if before:
    print(f"run-to-run noise: windows before the kill differ by {sum(before) / len(before):.2f} "
          f"points on average (at most {max(before):.2f})")
after = [(s, d) for s, d in diffs if s + 1e-9 >= at and d is not None]
dip = min((d for _, d in after), default=0.0)
recovered = next((s for s, d in after if s + 1e-9 >= at + down and d >= -5.0), None)
for m in ("control", "killed"):
    o = r[m]["overall"]
    print(f"{m:8s} hit rate {o['hit_rate'] * 100:6.2f} %  requests {o['requests']}  rerouted "
          f"{o['rerouted_requests']}  server failures {o['server_errors']}  corrupt blocks "
          f"{o['corrupt_blocks']} (must be 0)")
print(f"dip: {dip:+.2f} points at worst (a window against the same window of the control)")
print("recovered (the first window from the restart on within 5 points of the control's): " + (
    f"the window from {recovered:.1f} s, {recovered - at - down:.1f} s after the restart"
    if recovered is not None else "never, within the replay"))
print(f"reports in {out}")
EOF
    exit 0
fi

python3 - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
r = {m: json.load(open(f"{out}/{m}.json"))["result"] for m in ("islands", "cluster")}
def hr(m):
    return r[m]["overall"]["hit_rate"]
for m in ("islands", "cluster"):
    p = r[m]["policies"]
    print(f"{m:8s} hit rate {hr(m)*100:6.2f} %  (one cache of the same total capacity, "
          f"simulated LRU {p['lru']*100:.2f} %, unlimited {p['unlimited']*100:.2f} %)  "
          f"corrupt {r[m]['overall']['corrupt_blocks']}")
ratio = hr("cluster") / hr("islands") if hr("islands") > 0 else float("inf")
print(f"cluster / islands: {ratio:.2f}x   reports in {out}")
EOF
