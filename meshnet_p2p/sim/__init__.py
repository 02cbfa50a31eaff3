"""A simulated internet for the control plane's real code, in virtual time (issue 30).

``net``: datagrams between simulated hosts, each delivered after a one-way delay drawn
from a region model, some lost, some hosts behind NAT. ``churn``: heavy-tailed online
sessions. ``swarm``: the real ``DHTNode`` (routing table, lookups, gossip, record
verification, the DHT's defences) on that network under trio's ``MockClock``,
volunteers announcing signed capability reports, clients finding them, and what it
all cost. ``split``: the run over two processes, a core each, that agree every
lookahead of simulated time. ``bench/sim.py`` runs it; docs/scale.md has the figures and assumptions.
"""
