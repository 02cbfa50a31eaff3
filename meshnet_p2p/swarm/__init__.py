"""The swarm as records in the DHT: capability reports and the model index
(capability), relay announcements and their ranking (relay_offers), which
layers to serve and which route to take (placement), the certified view of a
model's recipes (view), a DHT node configured for these records and
joined through bootstrap peers (node), and a peer's announcements kept in the
DHT while it serves (announcer).

May import: core, engine, dht, trust.
"""
