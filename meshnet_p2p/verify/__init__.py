"""Verified compute: checking what peers computed, and what follows from it.

transcript: what one hop of a generation was given and answered, kept for replay.
replay: auditing one hop by exact replay on other peers of its recipe.
auditor: the client's audits, which hop-sessions are replayed and what their
verdicts do to each peer's record.
recheck: re-checking someone else's fraud proof by replay.
oracle: a certifier's own replay of any span, on its own copy of the whole model.
peer_records: what this client knows of each peer's computing, and how often it checks it.
crosscheck: cross-checked generation, two disjoint routes stepped side by side.
reports: fraud reports through the DHT, published and fetched.
review: a certifier's review round, its audits and re-checks tallied into signed verdicts.

May import: core, engine, dht, trust, swarm, dataplane, route.
"""
