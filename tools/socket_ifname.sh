#!/usr/bin/env bash
# The network interface that reaches the main node, for gloo's and NCCL's sockets:
#   tools/socket_ifname.sh <main address or hostname>   -> prints e.g. eth0
# On another node: the interface `ip route get` sends the main address through. On the main node itself that
# route is the loopback, so: the interface holding that address. A node whose hostname resolves to another
# network (a management interface) otherwise makes gloo and NCCL bind there, and the ranks hang at start-up.
# Exit 1 with nothing printed when no interface can be found (no `ip`, no route).
set -uo pipefail
main=${1:?usage: tools/socket_ifname.sh <main node address or hostname>}
addr=$(getent ahostsv4 "$main" 2>/dev/null | awk 'NR == 1 {print $1}')
addr=${addr:-$main}
command -v ip >/dev/null || exit 1
dev=$(ip -o -4 route get "$addr" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p')
if [ "$dev" = lo ]; then
    dev=$(ip -o -4 addr show 2>/dev/null | awk -v a="$addr" 'index($4, a "/") == 1 {print $2; exit}')
fi
[ -n "$dev" ] || exit 1   # lo only where the main address is a loopback one (every node on this host)
echo "$dev"
