"""gRPC over HTTP/2 over TLS bound to each peer's Ed25519 identity, on the
``h2`` library: a sans-io core (grpc_core), the socket driver, channels and a
pool of them (client side), a generic server that dispatches a registered
method table and hands each handler the caller's verified identity, and
dialing through a relay. Knows no service, message or protobuf.

May import: core.
"""
