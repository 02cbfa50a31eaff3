"""The control plane's Kademlia DHT and gossip: pure cores (routing, lookup,
storage, gossip, wire) and a thin trio node around them. It stores and
gossips signed records of any type the caller's verifier accepts, and knows
no model, recipe, relay or NAT.

May import: core.
"""
