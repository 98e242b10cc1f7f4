#!/usr/bin/env bash
# Pretend that this machine is a cluster: "nodes" made of Linux network namespaces, each with its own hostname
# (a UTS namespace) and a veth link to a bridge in a head namespace, from which mpirun starts the job. Open MPI
# reaches the nodes through `--mca plm_rsh_agent "launch/netns_nodes.sh rsh"` instead of ssh. Needs root and
# iproute2; every address lives inside the namespaces made here, and `down` removes them all.
#
#   bash launch/netns_nodes.sh up PREFIX N [SUBNET]   make PREFIX-head and nodes PREFIX-0 .. PREFIX-(N-1) (name
#                                                     them in a hostfile: `PREFIX-i slots=R`); SUBNET is the
#                                                     first three octets of their addresses (10.213.0)
#   bash launch/netns_nodes.sh shape PREFIX N RATE DELAY   shape each node's link with netem (1gbit 1ms)
#   bash launch/netns_nodes.sh rate PREFIX N RATE          limit each node's outgoing link to RATE (10mbit, 100mbit,
#                                                     1gbit) with a token bucket (tbf: kernels without netem)
#   bash launch/netns_nodes.sh head PREFIX CMD...     run CMD in the head namespace (where mpirun runs)
#   bash launch/netns_nodes.sh rsh NODE CMD...        run CMD on NODE (what Open MPI calls instead of ssh)
#   bash launch/netns_nodes.sh kill NODE              kill every process on NODE (a node failure)
#   bash launch/netns_nodes.sh down PREFIX N          remove the namespaces (also those half made)
#
# Example (2 nodes x 2 ranks, from the repository root):
#   bash launch/netns_nodes.sh up cb 2 && printf 'cb-0 slots=2\ncb-1 slots=2\n' > /tmp/hosts
#   bash launch/netns_nodes.sh head cb mpirun --hostfile /tmp/hosts -n 4 \
#       --mca plm_rsh_agent "$PWD/launch/netns_nodes.sh rsh" --mca oob_tcp_if_include 10.213.0.0/24 \
#       --mca btl_tcp_if_include 10.213.0.0/24 python -m crossbow_mpi.train ...
#   bash launch/netns_nodes.sh down cb 2
set -euo pipefail
say() { echo "launch/netns_nodes.sh: $*" >&2; }

up() {
    local prefix=$1 count=$2 subnet=${3:-10.213.0} head="$1-head"
    ip netns add "$head"
    ip -n "$head" link set lo up
    ip -n "$head" link add br0 type bridge
    ip -n "$head" addr add "$subnet.1/24" dev br0
    ip -n "$head" link set br0 up
    for ((i = 0; i < count; i++)); do
        local node="$prefix-$i"
        ip netns add "$node"
        ip -n "$node" link set lo up
        ip -n "$node" link add eth0 type veth peer name "port$i" netns "$head"
        ip -n "$node" addr add "$subnet.$((i + 2))/24" dev eth0
        ip -n "$node" link set eth0 up
        ip -n "$head" link set "port$i" master br0 up
    done
}

down() {
    local prefix=$1 count=$2
    for ((i = 0; i < count; i++)); do
        kill_node "$prefix-$i"
        ip netns del "$prefix-$i" 2>/dev/null || true
    done
    ip netns del "$prefix-head" 2>/dev/null || true
}

kill_node() {
    local pids
    mapfile -t pids < <(ip netns pids "$1" 2>/dev/null || true)
    [ "${#pids[@]}" = 0 ] || kill -9 "${pids[@]}" 2>/dev/null || true
}

case ${1:-} in
    up) shift; up "$@" ;;
    down) shift; down "$@" ;;
    shape)
        for ((i = 0; i < $3; i++)); do
            ip netns exec "$2-$i" tc qdisc replace dev eth0 root netem rate "$4" delay "$5"
        done
        ;;
    rate)
        for ((i = 0; i < $3; i++)); do
            ip netns exec "$2-$i" tc qdisc replace dev eth0 root tbf rate "$4" burst 256kb latency 100ms
        done
        ;;
    head) prefix=$2; shift 2; exec ip netns exec "$prefix-head" "$@" ;;
    # Each node's processes get the node's network and hostname: Open MPI tells nodes apart by both. Like ssh,
    # this shell stays outside the node and exits non-zero when the node's processes are killed.
    rsh)
        node=$2
        shift 2
        # shellcheck disable=SC2016  # $0 and $* expand in the node's shell
        ip netns exec "$node" unshare --uts sh -c 'hostname "$0" && exec sh -c "$*"' "$node" "$@" || exit 255
        ;;
    kill) kill_node "$2" ;;
    *) say "usage: up PREFIX N [SUBNET] | shape PREFIX N RATE DELAY | rate PREFIX N RATE | head PREFIX CMD... | rsh NODE CMD... | kill NODE | down PREFIX N"; exit 2 ;;
esac
