"""Beyond one machine: the cluster-wide step order and its store (etcd), Patroni's way.

Every node keeps its local guarantees (its own daemon, cgroups, NVML and ports); etcd holds
only what must be shared: the transition lock as a lease, each node's part state and verdict,
and the step order. No SSH, and no consensus of our own.
"""
