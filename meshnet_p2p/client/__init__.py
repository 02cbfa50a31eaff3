"""Using the swarm: the :class:`Client` API (api) over route finding and
stepping (route) and verified compute (verify), the one bridge between trio
and the client's blocking code (bridge), text in and out of a generation
(text), fetching parts of a model file from peers (fetch), and a model this
machine does not hold, by name (named).

May import: core, engine, dht, trust, swarm, dataplane, route, verify.
"""

from meshnet_p2p.route.errors import GenerationError, RequestRefused
from meshnet_p2p.route.hop import connect
from meshnet_p2p.route.options import PeerMeasures, RouteOptions

from .api import Client, GenerationResult, open_route

__all__ = ["Client", "GenerationError", "GenerationResult", "PeerMeasures", "RequestRefused", "RouteOptions",
           "connect", "open_route"]
