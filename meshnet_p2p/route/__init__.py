"""Finding and stepping a route through the swarm.

search: finding a route (the spans surveyed, the cheapest plan over peers not
set aside, first contacts side by side, bans of peers at fault).
probe: round trips to a route's candidates before its first plan.
hop: one hop of a route, its first contact, session and signed commitments.
chain: what a star route and a ring route share (the chain of open hops, the
route epoch, the failovers spent).
star: a star route, the client carrying every hidden state itself.
ring: a ring route, each peer forwarding to the next (docs/ring.md).
failover: blaming the hop at fault, replacing it and replaying its inputs.
generation: the one generation loop every route runs.
local: a whole route in one process, a chain of shard engines.
options: what a route is opened with, and what the client measured of peers.
errors: what a route's failures mean.

May import: core, engine, dht, trust, swarm, dataplane.
"""
