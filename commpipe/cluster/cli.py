"""`commpipe cluster`: build, inspect, throttle and tear down an emulated multi-node cluster.

    commpipe cluster up --nodes 4 --ranks-per-node 2 --inter-node-mbit 200   # stays up
    commpipe cluster status
    commpipe cluster rate --node 2 --inter-node-mbit 20      # degrade node 2's link (job running)
    commpipe cluster run --node 1 -- ip addr                 # a command inside node 1
    commpipe cluster down                                    # remove everything (also leftovers)
    commpipe cluster down --sweep runs/demo                  # what a killed sweep left behind

Needs root and iproute2; see commpipe/cluster/netns.py for the topology.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from commpipe.cluster import netns


def add_arguments(p) -> None:
    p.add_argument("action", choices=("up", "down", "status", "rate", "run"))
    add_options(p)
    # argparse cannot take options after a positional and then `-- cmd`: everything after the
    # action is captured here and split by split_rest()
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options, then with `run`: -- COMMAND")


def add_options(p) -> None:
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--inter-node-mbit", default=None,
                   help="Mbit/s, one value or one per node; with `rate`: the new rate ('off' removes it)")
    p.add_argument("--node", type=int, default=0, help="node for `rate` and `run`")
    p.add_argument("--prefix", default="cpn", help="name prefix of namespaces and links (default cpn)")
    p.add_argument("--json", action="store_true", help="`status`: print the raw JSON")
    p.add_argument("--sweep", default=None, metavar="DIR",
                   help="`down`: the prefix of the cluster that `commpipe sweep --out DIR` built "
                        "(read from DIR/cluster.json)")


def split_rest(args) -> None:
    """Options after the action go into args; what follows `--` becomes args.cmd."""
    rest = list(args.rest or [])
    cut = rest.index("--") if "--" in rest else len(rest)
    opts, args.cmd = rest[:cut], rest[cut + 1:]
    parser = argparse.ArgumentParser(prog=f"commpipe cluster {args.action}")
    add_options(parser)
    for key, value in vars(parser.parse_args(opts)).items():
        if value != parser.get_default(key):
            setattr(args, key, value)
    if args.cmd and args.action != "run":
        raise ValueError(f"`cluster {args.action}` takes no command; did you mean `cluster run`?")


def _bytes(n: int) -> str:
    for div, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def format_status(d: dict) -> str:
    """`cluster status` as a table: one row per node (namespace, address, link rate, bytes over
    its link, whether its namespace exists)."""
    present = set(d["present"]["namespaces"])
    lines = [f"cluster {d['prefix']}: {d['nodes']} nodes x {d['ranks_per_node']} ranks per node, subnet "
             f"{d['subnet']}, interface {d['ifname']} (GLOO_SOCKET_IFNAME)",
             f"{'node':>4}  {'namespace':<12} {'address':<15} {'link rate':<14} {'sent':>10} "
             f"{'received':>10}  state"]
    for i in range(d["nodes"]):
        rate = d["rates_mbit"][i]
        lb = d["link_bytes"][i]
        lines.append(f"{i:>4}  {d['namespaces'][i]:<12} {d['ips'][i]:<15} "
                     f"{'unthrottled' if rate is None else f'{rate:g} Mbit/s':<14} "
                     f"{_bytes(lb['sent']):>10} {_bytes(lb['received']):>10}  "
                     f"{'up' if d['namespaces'][i] in present else 'missing'}")
    return "\n".join(lines)


def _rates(text):
    from commpipe.cluster.sweep import parse_rates

    return parse_rates(text)


def sweep_prefix(sweep_dir) -> str:
    """The namespace prefix an emulated sweep wrote to its folder before building the cluster."""
    from commpipe.cluster.sweep import CLUSTER_FILE
    from commpipe.jsonfile import read_json_object

    path = os.path.join(sweep_dir, CLUSTER_FILE)
    if not os.path.exists(path):
        raise ValueError(f"--sweep {sweep_dir}: no {CLUSTER_FILE} there; only a sweep on an emulated "
                         "cluster writes one (a local sweep builds no namespaces)")
    prefix = read_json_object(path, "cluster").get("prefix")
    if not isinstance(prefix, str) or not prefix.isalnum():
        raise ValueError(f"{path}: prefix = {json.dumps(prefix)}: expected the cluster's "
                         "alphanumeric name prefix, e.g. \"cps1234\"")
    return prefix


def run(args) -> int:
    split_rest(args)
    try:
        return _run(args)
    except RuntimeError as e:          # an ip/tc command failed, or names are taken
        print(f"commpipe cluster: error: {e}", file=sys.stderr)
        return 1


def _run(args) -> int:
    if args.action == "down":
        if args.sweep:
            args.prefix = sweep_prefix(args.sweep)
        removed = netns.cleanup_stale(args.prefix)
        netns._state_file(args.prefix).unlink(missing_ok=True)
        print(f"removed {len(removed['namespaces'])} namespaces and {len(removed['links'])} links "
              f"named {args.prefix}*")
        return 0
    ok, why = netns.available()
    if not ok:
        print(f"commpipe cluster: {why}", file=sys.stderr)
        return 2
    if args.action == "up":
        c = netns.EmulatedCluster(args.nodes, args.ranks_per_node, _rates(args.inter_node_mbit),
                                  prefix=args.prefix, keep=True).up()
        d = c.describe()
        print(f"cluster {args.prefix}: {c.nodes} nodes x {c.ranks_per_node} ranks, interface "
              f"{d['ifname']}, nodes at {', '.join(d['ips'])}")
        print(f"run on node i: ip netns exec {args.prefix}n<i> <cmd>   (GLOO_SOCKET_IFNAME={d['ifname']})")
        return 0
    c = netns.EmulatedCluster.attach(args.prefix)
    if args.action == "status":
        d = c.describe()
        d["present"] = netns.list_resources(args.prefix)
        d["link_bytes"] = [c.link_bytes(i) for i in range(c.nodes)]
        print(json.dumps(d, indent=1) if args.json else format_status(d))
        return 0
    if args.action == "rate":
        text = args.inter_node_mbit
        if text is None:
            raise ValueError("give the new rate: --inter-node-mbit R (Mbit/s) or --inter-node-mbit off")
        off = str(text).lower() == "off"
        c.set_rate(args.node, None if off else float(text))
        print(f"node {args.node} link: " + ("unthrottled" if off else f"{float(text):g} Mbit/s"))
        return 0
    if not args.cmd:
        raise ValueError("give the command after --, e.g. commpipe cluster run --node 1 -- ip addr")
    env = dict(os.environ, GLOO_SOCKET_IFNAME=netns.NS_IFNAME)
    c._check_node(args.node)
    return subprocess.call(["ip", "netns", "exec", c.ns(args.node), *args.cmd], env=env)
