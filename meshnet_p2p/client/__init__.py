"""Using the swarm: finding a certified route, stepping it (star or ring),
failing over and blaming one hop, the generation loop, a local route in one
process, and the :class:`Client` API on top.

May import: core, engine, dht, trust, swarm, dataplane.
"""
