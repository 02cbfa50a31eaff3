"""Reaching peers behind NAT: dial-back checks by other peers (dialback,
reachability), the relay that splices TLS it cannot read (relay, circuits),
and the keeper that holds a reservation on the best relay and moves when it
goes (keeper).

May import: core, engine, dht, trust, swarm, dataplane.
"""
