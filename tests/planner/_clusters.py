"""Small made-up clusters for planner tests: slow enough that compute, transfers and the
data-parallel collectives all count."""

from __future__ import annotations

from dataclasses import replace

from pipepar.planner.cluster import Cluster, Link

LINK = Link(bandwidth=1e9, latency=1e-5)


def cluster(*, per_node: int = 2, nodes: int = 2, link: Link = LINK) -> Cluster:
    """``nodes`` nodes of ``per_node`` devices of 100 MFLOP/s and 1 GiB; ``link`` within a
    node, ten times less bandwidth across."""
    return Cluster(
        name="test",
        device="test device",
        devices_per_node=per_node,
        nodes=nodes,
        memory_bytes=2**30,
        flops=1e8,
        efficiency=1.0,
        intra=link,
        inter=replace(link, bandwidth=link.bandwidth / 10),
    )
