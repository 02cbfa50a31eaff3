"""Foundations every layer stands on: the typed error root (errors), Ed25519
identities and libp2p peer IDs (identity), the one signed envelope for every
record on the network (records), multiaddrs, which network an address counts
in (netgroup), rate limiting, counters and histograms (stats), the guard that
keeps a background loop's exception from ending a process, signal handling.

May import: nothing of meshnet_p2p outside core.
"""
