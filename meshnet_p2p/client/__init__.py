"""Using the swarm: finding a certified route, stepping it (star or ring),
failing over and blaming one hop, the generation loop, a local route in one
process, and the :class:`Client` API on top.

May import: core, engine, dht, trust, swarm, dataplane.
"""

from .api import Client, GenerationResult, open_route
from .errors import GenerationError, RequestRefused
from .hop import connect
from .options import PeerMeasures, RouteOptions

__all__ = ["Client", "GenerationError", "GenerationResult", "PeerMeasures", "RequestRefused", "RouteOptions",
           "connect", "open_route"]
