"""The data plane: the ShardRuntime gRPC service (servicer, session state,
admission, the ring's links) over a transport that knows no application
(``transport``). Protobuf stays here: ``wire`` is the one module that converts
between the wire's messages and engine and trust types; ``stub`` is the typed
client of a peer's service.

May import: core, engine, trust, swarm (capability reports a ring link checks).
"""
