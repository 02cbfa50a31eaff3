"""The control plane's Kademlia DHT and gossip: pure cores (routing, lookup,
storage, gossip, wire) and a thin trio node around them."""
